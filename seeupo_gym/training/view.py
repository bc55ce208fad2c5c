"""`seeupo-view RUN_DIR`: a run's recorded episodes as one static HTML page.

    seeupo-view runs/tiny-turnbandit                      # writes runs/tiny-turnbandit/rollouts.html
    seeupo-view runs/x --out page.html --steps 10:20      # steps 10 to 20 only
    seeupo-view runs/x --serve                            # and serves it on http://127.0.0.1:8765/

Episodes are grouped by task, turn by turn: the context delta, the response, the tool calls and the
env's answer, the reward, and what the update did with the turn (A, and SeeUPO's M and ratio).
Filters by task, reward, step and text run in the page (also from the address:
`rollouts.html#task=ID&rmin=0.5&smin=10&text=error`). The page is self-contained (inline CSS and
JS, nothing fetched) and holds every episode asked for.

Model text is hostile: every string is HTML-escaped on the way in, and the page's Content Security
Policy lets only its own script (by hash) run, so a response holding `<script>` is shown, not run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import http.server
import math
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from seeupo_gym.text import counted, valid_unicode
from seeupo_gym.training.rollouts import read_rollouts

PAGE_FILE = "rollouts.html"
DEFAULT_PORT = 8765
# Control characters other than tab and newline: shown as \xNN instead of being sent to the browser.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 16px;z-index:1}
header h1{font-size:18px;margin:0 0 4px}
.filters{display:flex;gap:12px;flex-wrap:wrap;align-items:center}
.filters input[type=number]{width:5em}
main{padding:8px 16px}
section.task{margin:12px 0;background:#fff;border:1px solid #ddd;border-radius:6px;padding:4px 12px}
section.task h2{font-size:15px;margin:8px 0}
details.episode{border-top:1px solid #eee;padding:4px 0}
details.episode>summary{cursor:pointer}
.reward{display:inline-block;min-width:4em;font-weight:600;font-family:monospace}
.r-good{color:#11772f}.r-mid{color:#9a6a00}.r-zero{color:#b3261e}
.turn{margin:6px 0 6px 16px;border-left:3px solid #c7d2fe;padding-left:8px}
.turn-head{font-weight:600}
.label{color:#555;font-size:12px;margin-top:4px}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f6;padding:6px;margin:2px 0;max-height:30em;overflow:auto}
pre.response{background:#eef6ee}
code{font-family:monospace}
.meta{color:#666;font-weight:normal}
.num{font-family:monospace}
"""

_JS = """
(function(){
  var task=document.getElementById('f-task'), rmin=document.getElementById('f-rmin'),
      rmax=document.getElementById('f-rmax'), smin=document.getElementById('f-smin'),
      smax=document.getElementById('f-smax'), text=document.getElementById('f-text'),
      shown=document.getElementById('shown');
  function num(el, fallback){var v=parseFloat(el.value);return isNaN(v)?fallback:v;}
  function apply(){
    var t=task.value, lo=num(rmin,-Infinity), hi=num(rmax,Infinity), s0=num(smin,-Infinity), s1=num(smax,Infinity),
        q=text.value.toLowerCase(), count=0;
    document.querySelectorAll('section.task').forEach(function(sec){
      var visible=0, sameTask=(t==='' || sec.dataset.task===t);
      sec.querySelectorAll('details.episode').forEach(function(ep){
        var r=parseFloat(ep.dataset.reward), s=parseInt(ep.dataset.step,10);
        var ok=sameTask && !(r<lo) && !(r>hi) && s>=s0 && s<=s1 && (q==='' || ep.textContent.toLowerCase().indexOf(q)>=0);
        ep.hidden=!ok; if(ok){visible++;}
      });
      sec.hidden=(visible===0); count+=visible;
    });
    shown.textContent=String(count);
  }
  // Filters can come in the address: page.html#task=ID&rmin=0.5&smax=10&text=word
  var fields={task:task,rmin:rmin,rmax:rmax,smin:smin,smax:smax,text:text};
  new URLSearchParams(location.hash.slice(1)).forEach(function(v,k){if(fields[k]){fields[k].value=v;}});
  [task,rmin,rmax,smin,smax,text].forEach(function(el){el.addEventListener('input',apply);});
  apply();
})();
"""


def _text(value: Any) -> str:
    """Any value as safe HTML text: valid Unicode, control characters made visible, escaped."""
    text = value if isinstance(value, str) else str(value)
    text = valid_unicode(text)
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return html.escape(text, quote=True)


def _number(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "–"
    return f"{value:+.{digits}f}" if digits else str(value)


def _reward_class(reward: Any) -> str:
    if not isinstance(reward, (int, float)) or reward <= 0:
        return "r-zero"
    return "r-good" if reward >= 1 else "r-mid"


def _turn_html(turn: dict[str, Any]) -> str:
    values = [f"A {_number(turn.get('advantage'))}"]
    if turn.get("m") is not None:
        values.append(f"M {_number(turn.get('m'))}")
    if turn.get("ratio") is not None:
        values.append(f"ratio {_number(turn.get('ratio'), 4)}")
    if turn.get("update_order") is not None:
        values.append(f"updated {_text(turn.get('update_order'))}.")
    parts = [
        '<div class="turn">',
        f'<div class="turn-head">Turn {_text(turn.get("t", "?"))} '
        f'<span class="meta num">{" · ".join(values)}</span></div>',
        f'<details><summary class="label">context delta: {_text(counted(turn.get("context_tokens", 0), "token"))} in all, '
        f'{_text(turn.get("context_kept_tokens", 0))} kept from the previous turn</summary>'
        f'<pre class="context">{_text(turn.get("context_delta", ""))}</pre></details>',
        f'<div class="label">response ({_text(counted(turn.get("response_tokens", 0), "token"))}, '
        f'finish: {_text(turn.get("finish_reason", ""))})</div>',
        f'<pre class="response">{_text(turn.get("response", ""))}</pre>',
    ]
    calls = turn.get("tool_calls") or []
    if calls:
        items = "".join(f"<li><code>{_text(c.get('name', ''))}({_text(c.get('arguments', ''))})</code></li>"
                        for c in calls if isinstance(c, dict))
        parts.append(f'<div class="label">tool calls</div><ul class="calls">{items}</ul>')
    for message in turn.get("observation") or []:
        if not isinstance(message, dict):
            continue
        who = message.get("role", "")
        if message.get("name"):
            who = f"{who} {message['name']}"
        parts.append(f'<div class="label">{_text(who)}</div><pre class="observation">{_text(message.get("content", ""))}</pre>')
    parts.append("</div>")
    return "".join(parts)


def _episode_html(record: dict[str, Any], open_: bool) -> str:
    reward = record.get("reward")
    reward_value = reward if isinstance(reward, (int, float)) and math.isfinite(reward) else 0.0
    step = record.get("step") if isinstance(record.get("step"), int) else 0
    flags = [_text(counted(record.get('num_turns', len(record.get('turns') or [])), "turn")), f"end {_text(record.get('end', ''))}"]
    if record.get("success"):
        flags.append("success")
    if record.get("advantage") is not None:
        flags.append(f"A {_number(record.get('advantage'))}")
    if record.get("error"):
        flags.append(f"error: {_text(record.get('error'))}")
    turns = "".join(_turn_html(t) for t in record.get("turns") or [] if isinstance(t, dict))
    return (
        f'<details class="episode" data-task="{_text(record.get("task_id", ""))}" data-reward="{reward_value!r}" '
        f'data-step="{step}"{" open" if open_ else ""}>'
        f'<summary><span class="reward {_reward_class(reward)}">{_number(reward_value)}</span> '
        f'step {step} · rollout <code>{_text(record.get("rollout_id", ""))}</code> · {" · ".join(flags)}</summary>'
        f"{turns}</details>"
    )


def render_page(records: Iterable[dict[str, Any]], *, title: str = "rollouts", about: str = "") -> str:
    """The HTML page of these episode records (rollouts.py's schema), grouped by task."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    total = 0
    for record in records:
        by_task[str(record.get("task_id", ""))].append(record)
        total += 1
    sections = []
    first = True
    for task_id in sorted(by_task):
        episodes = sorted(by_task[task_id], key=lambda r: (r.get("step", 0) if isinstance(r.get("step"), int) else 0,
                                                          str(r.get("rollout_id", ""))))
        rewards = [r["reward"] for r in episodes if isinstance(r.get("reward"), (int, float))]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        rows = []
        for record in episodes:
            rows.append(_episode_html(record, open_=first))
            first = False
        sections.append(
            f'<section class="task" data-task="{_text(task_id)}"><h2>Task <code>{_text(task_id)}</code> '
            f'<span class="meta">{len(episodes)} episodes · mean reward {_number(mean)}</span></h2>{"".join(rows)}</section>'
        )
    options = "".join(f'<option value="{_text(t)}">{_text(t)}</option>' for t in sorted(by_task))
    script_hash = base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()
    # Only the page's own script (by hash) may run; nothing is fetched.
    policy = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
        f"<title>{_text(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{_text(title)}</h1><div class=\"meta\">{_text(about)}</div>"
        '<div class="filters">'
        f'<label>task <select id="f-task"><option value="">all {len(by_task)}</option>{options}</select></label>'
        '<label>reward from <input id="f-rmin" type="number" step="0.1"> to <input id="f-rmax" type="number" step="0.1"></label>'
        '<label>step from <input id="f-smin" type="number" step="1"> to <input id="f-smax" type="number" step="1"></label>'
        '<label>text <input id="f-text" type="search"></label>'
        f'<span>showing <span id="shown">{total}</span> of <span id="total">{total}</span> episodes</span>'
        "</div></header>"
        f"<main>{''.join(sections) or '<p>No episodes recorded.</p>'}</main>"
        f"<script>{_JS}</script></body></html>\n"
    )


def _about(run_dir: Path) -> str:
    """One line from the run's config.yaml: algorithm, env, model (nothing when it cannot be read)."""
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        return (f"algorithm {config['algorithm']['name']} · env {config['env']['id']} {config['env'].get('kwargs') or ''} · "
                f"model {config['model']['name_or_path']}")
    except Exception:  # noqa: BLE001  the page does without it
        return ""


def parse_steps(spec: str | None) -> tuple[int, int] | None:
    """"10:20" (inclusive), "10:" or ":20" or "7"."""
    if not spec:
        return None
    low, sep, high = spec.partition(":")
    try:
        lo = int(low) if low.strip() else 0
        hi = int(high) if high.strip() else (lo if not sep else 2**62)
    except ValueError:
        raise ValueError(f"--steps must look like 10:20, 10:, :20 or 7; got {spec!r}") from None
    return lo, hi


def write_page(run_dir: str | Path, out: str | Path | None = None, *, steps: tuple[int, int] | None = None) -> Path:
    """Render the run's recorded episodes (optionally only `steps`, inclusive) to `out`
    (default RUN_DIR/rollouts.html)."""
    run = Path(run_dir)
    records: Iterable[dict[str, Any]] = read_rollouts(run)
    if steps is not None:
        records = (r for r in records if isinstance(r.get("step"), int) and steps[0] <= r["step"] <= steps[1])
    page = render_page(records, title=f"{run.resolve().name}: rollouts", about=_about(run if run.is_dir() else run.parent))
    target = Path(out) if out is not None else (run if run.is_dir() else run.parent) / PAGE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target


def serve(page: Path, port: int = DEFAULT_PORT) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 (never another interface) that answers GET / with the page.

    Returns the server, not yet serving: call `serve_forever()` (or run it in a thread).
    """
    body = page.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            if self.path.split("?", 1)[0] not in ("/", "/index.html", f"/{PAGE_FILE}"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seeupo-view", description="A run's recorded episodes as a static HTML page.")
    parser.add_argument("run_dir", help="a run folder (log.output_dir) holding rollouts.jsonl.gz")
    parser.add_argument("--out", help=f"the page to write (default RUN_DIR/{PAGE_FILE})")
    parser.add_argument("--steps", help="only these training steps, e.g. 10:20 (inclusive), 10:, :20 or 7")
    parser.add_argument("--serve", action="store_true", help="then serve the page on 127.0.0.1 until interrupted")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port for --serve (default {DEFAULT_PORT}; 0: any free one)")
    args = parser.parse_args(argv)
    try:
        page = write_page(args.run_dir, args.out, steps=parse_steps(args.steps))
    except (FileNotFoundError, ValueError) as error:
        print(f"seeupo-view: {error}", file=sys.stderr)
        return 2
    print(f"wrote {page}")
    if args.serve:
        try:
            server = serve(page, args.port)
        except OSError as error:
            print(f"seeupo-view: cannot listen on 127.0.0.1:{args.port}: {error}", file=sys.stderr)
            return 2
        print(f"serving on http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
