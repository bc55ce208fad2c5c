"""`seeupo-view RUN_DIR`: a run's recorded episodes as one static HTML page.

    seeupo-view runs/tiny-turnbandit                      # writes runs/tiny-turnbandit/rollouts.html
    seeupo-view runs/x --out page.html --steps 10:20      # steps 10 to 20 only
    seeupo-view runs/x --serve                            # and serves it on http://127.0.0.1:8765/

Episodes are grouped by task, turn by turn: the context delta, the response, the tool calls and the
env's answer, the reward, and what the update did with the turn (A, and SeeUPO's M and ratio).
Filters by task, reward, step and text run in the page (also from the address:
`rollouts.html#task=ID&rmin=0.5&smin=10&text=error`); each task's header counts what they keep, and
a filter that keeps nothing says so. The page is self-contained (inline CSS and JS, nothing fetched)
and holds every episode asked for.

Model text is hostile: every string is HTML-escaped on the way in, odd numbers (NaN, a 401-digit
int) are shown as text, and the page's Content Security Policy lets only its own script (by hash)
run, so a response holding `<script>` is shown, not run. `--serve` answers only its own `Host`,
bounds each request head in time and the connections in number (see `serve`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import http.server
import io
import math
import re
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from seeupo_gym.text import counted, valid_unicode
from seeupo_gym.training.rollouts import read_rollouts

PAGE_FILE = "rollouts.html"
DEFAULT_PORT = 8765
# --serve: the whole request head must arrive within HEAD_TIMEOUT_S, the page leave within
# SEND_TIMEOUT_S; at most MAX_CONNECTIONS are served at once (a browser opens about 6).
HEAD_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 32
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
.none{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px;font-size:15px}
"""

_JS = """
(function(){
  function $(id){return document.getElementById(id);}
  var task=$('f-task'), rmin=$('f-rmin'), rmax=$('f-rmax'), smin=$('f-smin'), smax=$('f-smax'), text=$('f-text'),
      shown=$('shown'), none=$('none-shown'), noneWhat=$('none-what'), clear=$('f-clear');
  var fields={task:task,rmin:rmin,rmax:rmax,smin:smin,smax:smax,text:text};
  function num(el, fallback){var v=parseFloat(el.value);return isNaN(v)?fallback:v;}
  // A record without a number (NaN) passes only while that range is open.
  function inRange(v, lo, hi){return isNaN(v) ? (lo===-Infinity && hi===Infinity) : (v>=lo && v<=hi);}
  function plural(n, noun){return n+' '+noun+(n===1?'':'s');}
  function signed(v){return (v>=0?'+':'')+(Math.abs(v)<1e12 ? v.toFixed(3) : v.toExponential(3));}
  function apply(){
    var t=task.value, lo=num(rmin,-Infinity), hi=num(rmax,Infinity), s0=num(smin,-Infinity), s1=num(smax,Infinity),
        q=text.value.toLowerCase(), count=0;
    document.querySelectorAll('section.task').forEach(function(sec){
      var kept=[], all=0, sameTask=(t==='' || sec.dataset.task===t);
      sec.querySelectorAll('details.episode').forEach(function(ep){
        var r=parseFloat(ep.dataset.reward), s=parseInt(ep.dataset.step,10);
        var ok=sameTask && inRange(r,lo,hi) && inRange(s,s0,s1) && (q==='' || ep.textContent.toLowerCase().indexOf(q)>=0);
        ep.hidden=!ok; all++; if(ok){kept.push(r);}
      });
      sec.hidden=(kept.length===0); count+=kept.length;
      // The task's header counts what the filters keep: "2 of 4 episodes · mean reward +0.500".
      var finite=kept.filter(function(r){return isFinite(r);}), mean=0;
      finite.forEach(function(r){mean+=r/finite.length;});
      var stats=(kept.length===all ? '' : kept.length+' of ')+plural(all,'episode')+' · mean reward '+(finite.length ? signed(mean) : '\u2013');
      if(finite.length<kept.length){stats+=' · '+plural(kept.length-finite.length,'reward')+' not a finite number';}
      sec.querySelector('.task-stats').textContent=stats;
    });
    shown.textContent=String(count);
    if(none){
      var active=[];
      if(t!==''){active.push('task '+t);}
      if(rmin.value!==''||rmax.value!==''){active.push('reward from '+(rmin.value||'any')+' to '+(rmax.value||'any'));}
      if(smin.value!==''||smax.value!==''){active.push('step from '+(smin.value||'any')+' to '+(smax.value||'any'));}
      if(q!==''){active.push('text "'+text.value+'"');}
      noneWhat.textContent=active.join(', ');
      none.hidden=(count!==0);
    }
  }
  // Filters can come in the address: page.html#task=ID&rmin=0.5&smax=10&text=word
  function fromAddress(){
    Object.keys(fields).forEach(function(k){fields[k].value='';});
    new URLSearchParams(location.hash.slice(1)).forEach(function(v,k){
      if(!fields[k]){return;}
      if(k==='task' && v!=='' && !Array.prototype.some.call(task.options,function(o){return o.value===v;})){
        var missing=document.createElement('option');  // else the select drops it and shows every task
        missing.value=v; missing.textContent=v+' (not in this page)'; task.appendChild(missing);
      }
      fields[k].value=v;
    });
    apply();
  }
  if(clear){clear.addEventListener('click', function(){
    Object.keys(fields).forEach(function(k){fields[k].value='';});
    try{history.replaceState(null,'',location.pathname+location.search);}catch(e){}
    apply();
  });}
  Object.keys(fields).forEach(function(k){fields[k].addEventListener('input',apply);});
  window.addEventListener('hashchange',fromAddress);
  fromAddress();
})();
"""


def _plain(value: Any, depth: int = 0) -> str:
    """Any JSON value as short plain text, whatever it holds: a 5,000-digit int, NaN, deep nesting."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return str(value)
        # str() of a huge int is slow and refused past 4,300 digits: say its size instead.
        return f"{'minus ' if value < 0 else ''}an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, float):
        return repr(value)  # nan, inf, 1e+308
    if isinstance(value, dict):
        if depth >= 3:
            return "{…}"
        pairs = [f"{_plain(k, depth + 1)}: {_plain(v, depth + 1)}" for k, v in list(value.items())[:20]]
        return "{" + ", ".join(pairs + ["…"] * (len(value) > 20)) + "}"
    if isinstance(value, (list, tuple)):
        if depth >= 3:
            return "[…]"
        items = [_plain(v, depth + 1) for v in value[:20]]
        return "[" + ", ".join(items + ["…"] * (len(value) > 20)) + "]"
    return f"({type(value).__name__})"


def _text(value: Any) -> str:
    """Any value as safe HTML text: valid Unicode, control characters made visible, escaped."""
    text = valid_unicode(_plain(value))
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return html.escape(text, quote=True)


def _finite(value: Any) -> float | None:
    """A number as a finite float; None for NaN, infinities, ints too large for a float and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _number(value: Any, digits: int = 3) -> str:
    """A value as signed fixed-point HTML text; an odd one (NaN, 10**400, a string) as its own text."""
    number = _finite(value)
    if number is not None:
        return f"{number:+.{digits}f}" if abs(number) < 1e12 else f"{number:+.{digits}e}"
    return "–" if value is None else _text(value)


def _js_number(value: Any) -> str:
    """A reward for the page's filters: parseFloat reads it; NaN where there is no number."""
    number = _finite(value)
    if number is not None:
        return repr(number)
    if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and not math.isnan(value)):
        return "Infinity" if value > 0 else "-Infinity"
    return "NaN"


def _step(value: Any) -> int | None:
    """A training step the page can sort and filter on (an int a browser reads exactly), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53 else None


def _count(value: Any, noun: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() <= 64:
        return _text(counted(value, noun))
    return _text(f"{_plain(value)} {noun}s")


def _items(value: Any) -> list[Any]:
    """A record's list field; anything else in its place holds no items."""
    return value if isinstance(value, list) else []


def _reward_class(reward: Any) -> str:
    number = _finite(reward)
    if number is None or number <= 0:
        return "r-zero"
    return "r-good" if number >= 1 else "r-mid"


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
        f'<details><summary class="label">context delta: {_count(turn.get("context_tokens", 0), "token")} in all, '
        f'{_text(turn.get("context_kept_tokens", 0))} kept from the previous turn</summary>'
        f'<pre class="context">{_text(turn.get("context_delta", ""))}</pre></details>',
        f'<div class="label">response ({_count(turn.get("response_tokens", 0), "token")}, '
        f'finish: {_text(turn.get("finish_reason", ""))})</div>',
        f'<pre class="response">{_text(turn.get("response", ""))}</pre>',
    ]
    calls = [c for c in _items(turn.get("tool_calls")) if isinstance(c, dict)]
    if calls:
        items = "".join(f"<li><code>{_text(c.get('name', ''))}({_text(c.get('arguments', ''))})</code></li>" for c in calls)
        parts.append(f'<div class="label">tool calls</div><ul class="calls">{items}</ul>')
    for message in _items(turn.get("observation")):
        if not isinstance(message, dict):
            continue
        who = _plain(message.get("role", ""))
        if message.get("name"):
            who = f"{who} {_plain(message['name'])}"
        parts.append(f'<div class="label">{_text(who)}</div><pre class="observation">{_text(message.get("content", ""))}</pre>')
    parts.append("</div>")
    return "".join(parts)


def _episode_html(record: dict[str, Any], open_: bool) -> str:
    reward = record.get("reward")
    step = _step(record.get("step"))
    shown_step = step if step is not None else _text(record.get("step", "?"))
    flags = [_count(record.get("num_turns", len(_items(record.get("turns")))), "turn"), f"end {_text(record.get('end', ''))}"]
    if record.get("success"):
        flags.append("success")
    if record.get("advantage") is not None:
        flags.append(f"A {_number(record.get('advantage'))}")
    if record.get("error"):
        flags.append(f"error: {_text(record.get('error'))}")
    turns = "".join(_turn_html(t) for t in _items(record.get("turns")) if isinstance(t, dict))
    return (
        f'<details class="episode" data-task="{_text(record.get("task_id", ""))}" data-reward="{_js_number(reward)}" '
        f'data-step="{"" if step is None else step}"{" open" if open_ else ""}>'
        f'<summary><span class="reward {_reward_class(reward)}">{_number(reward)}</span> '
        f'step {shown_step} · rollout <code>{_text(record.get("rollout_id", ""))}</code> · {" · ".join(flags)}</summary>'
        f"{turns}</details>"
    )


def _episode_or_note(record: Any, open_: bool) -> str:
    """The episode's HTML; a record no rule above foresaw still gets a line, and the page still builds."""
    try:
        if not isinstance(record, dict):
            raise TypeError(f"a {type(record).__name__}, not an episode record")
        return _episode_html(record, open_)
    except Exception as error:  # noqa: BLE001  one odd record must not cost the page
        return (f'<details class="episode" data-task="" data-reward="NaN" data-step=""><summary>a record that could not '
                f"be laid out: {_text(type(error).__name__)}</summary><pre>{_text(record)}</pre></details>")


def _task_stats(episodes: list[Any]) -> str:
    """`4 episodes · mean reward +0.500`: the page's script rewrites it for the episodes the filters keep."""
    rewards = [_finite(r.get("reward")) if isinstance(r, dict) else None for r in episodes]
    finite = [r for r in rewards if r is not None]
    stats = f"{counted(len(episodes), 'episode')} · mean reward {_number(math.fsum(r / len(finite) for r in finite)) if finite else '–'}"
    if len(finite) < len(episodes):
        stats += f" · {counted(len(episodes) - len(finite), 'reward')} not a finite number"
    return stats


def render_page(records: Iterable[dict[str, Any]], *, title: str = "rollouts", about: str = "") -> str:
    """The HTML page of these episode records (rollouts.py's schema), grouped by task."""
    by_task: dict[str, list[Any]] = defaultdict(list)
    total = 0
    for record in records:
        by_task[_plain(record.get("task_id", "")) if isinstance(record, dict) else ""].append(record)
        total += 1
    sections = []
    first = True
    for task_id in sorted(by_task):
        episodes = sorted(by_task[task_id], key=lambda r: (_step(r.get("step")) or 0, _plain(r.get("rollout_id", "")))
                          if isinstance(r, dict) else (0, ""))
        rows = []
        for record in episodes:
            rows.append(_episode_or_note(record, open_=first))
            first = False
        sections.append(
            f'<section class="task" data-task="{_text(task_id)}"><h2>Task <code>{_text(task_id)}</code> '
            f'<span class="meta task-stats">{_task_stats(episodes)}</span></h2>{"".join(rows)}</section>'
        )
    options = "".join(f'<option value="{_text(t)}">{_text(t)}</option>' for t in sorted(by_task))
    script_hash = base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()
    # Only the page's own script (by hash) may run; nothing is fetched.
    policy = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    # Shown by the script when the filters hide every episode (else the page is an empty grey field).
    none_shown = ('<p id="none-shown" class="none" hidden>No episode matches the filters '
                  '(<span id="none-what"></span>). <button id="f-clear" type="button">Clear the filters</button> '
                  "or open the page without the part after <code>#</code> in its address.</p>")
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
        f"<main>{none_shown if total else ''}{''.join(sections) or '<p>No episodes recorded.</p>'}</main>"
        f"<script>{_JS}</script></body></html>\n"
    )


def _about(run_dir: Path) -> str:
    """One line from the run's config.yaml: algorithm, env, model (nothing when it cannot be read)."""
    try:
        from seeupo_gym.training.config import parse_yaml  # no aliases: a bomb is an error, not a hang

        config = parse_yaml((run_dir / "config.yaml").read_text())
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


class _HeadDeadlineReader(io.RawIOBase):
    """The socket read with one deadline for the whole request head: a client that drips a byte a
    second is cut at it, not kept for as long as it likes."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request head took too long")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _PageServer(http.server.ThreadingHTTPServer):
    """A thread per connection, but at most `max_connections` of them. When they are all taken, the
    one that has waited longest for its request head gives way to the new one (so sockets held idle
    to fill the slots cannot lock a reader out); if none is waiting, the new one is answered 503."""

    daemon_threads = True
    request_queue_size = 1024  # waiting in the kernel costs no thread

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._heads_awaited: dict[socket.socket, float] = {}  # connection -> when it opened

    def awaiting_head(self, connection: socket.socket, waiting: bool) -> None:
        with self._lock:
            if waiting:
                self._heads_awaited[connection] = time.monotonic()
            else:
                self._heads_awaited.pop(connection, None)

    def _evict_the_longest_waiting(self) -> bool:
        with self._lock:
            if not self._heads_awaited:
                return False
            oldest = min(self._heads_awaited, key=self._heads_awaited.__getitem__)
            del self._heads_awaited[oldest]
            try:
                oldest.shutdown(socket.SHUT_RDWR)  # its thread's read returns: the handler ends, the slot frees
            except OSError:
                pass
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not (
                self._evict_the_longest_waiting() and self._slots.acquire(timeout=2.0)):
            try:
                request.setblocking(False)
                request.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.awaiting_head(request, True)  # here, not in its thread: evictable before that thread runs
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.awaiting_head(request, False)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away or stalled: nothing to report


def serve(page: Path, port: int = DEFAULT_PORT, *, head_timeout_s: float = HEAD_TIMEOUT_S,
          send_timeout_s: float = SEND_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 (never another interface) that answers GET / with the page.

    Only requests whose `Host` names this server (`127.0.0.1:PORT` or `localhost:PORT`) get it: a
    page elsewhere that rebinds its own name to 127.0.0.1 gets 403. Each connection has
    `head_timeout_s` for its whole request head and `send_timeout_s` to take the page; at most
    `max_connections` are served at once (see `_PageServer`). Returns the server, not yet serving: call
    `serve_forever()` (or run it in a thread).
    """
    body = page.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the plain reader: replaced by one with a deadline for the whole head
            self.rfile = io.BufferedReader(_HeadDeadlineReader(self.connection, time.monotonic() + head_timeout_s))

        def parse_request(self) -> bool:
            parsed = super().parse_request()  # reads the headers
            self.server.awaiting_head(self.connection, False)  # the head is in: no longer one to evict
            return parsed

        def finish(self) -> None:
            self.server.awaiting_head(self.connection, False)
            super().finish()

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            self.connection.settimeout(send_timeout_s)  # sendall: each reply within it
            bound = self.server.server_address[1]
            hosts = self.headers.get_all("Host") or []
            if len(hosts) != 1 or hosts[0].strip().lower() not in (f"127.0.0.1:{bound}", f"localhost:{bound}"):
                self.send_error(403, "this server answers only http://127.0.0.1:PORT/ and http://localhost:PORT/")
                return
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

    return _PageServer(("127.0.0.1", port), Handler, max_connections)


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
