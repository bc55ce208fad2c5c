"""Write NeMo Gym rows for tasks of a served env: `python prepare_data.py --url URL --agent NAME
--out FILE [--tasks a,b | --limit N] [--seeds 0,1]`.

Each row holds the served env's system prompt (`responses_create_params.input`), its sha256, the
task id (and seed) the resource server resets with, and the agent that runs it. The prompt comes
from the server, so rows match the kwargs it serves (`app.py` refuses a row that does not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app import prompt_sha256  # noqa: E402
from seeupo_serve_client import ServeSession, served_env, system_messages  # noqa: E402


def served_task_ids(url: str) -> list[str]:
    task_ids = served_env(url).get("task_ids")
    if not isinstance(task_ids, list) or not all(isinstance(task, str) for task in task_ids):
        raise SystemExit(f"prepare_data: {url} lists no task ids; pass --tasks")
    return task_ids


async def rows(url: str, agent: str, task_ids: list[str | None], seeds: list[int | None]) -> list[dict]:
    out = []
    async with ServeSession(url) as session:
        for task_id, seed in ((task_id, seed) for task_id in task_ids for seed in seeds):
            options = {key: value for key, value in (("task_id", task_id), ("seed", seed)) if value is not None}
            system = system_messages((await session.reset(**options)).messages)
            out.append({"responses_create_params": {"input": system}, **options, "prompt_sha256": prompt_sha256(system),
                        "agent_ref": {"type": "responses_api_agents", "name": agent}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the seeupo-serve URL")
    parser.add_argument("--agent", required=True, help="the config's agent name, e.g. seeupo_bfcl_agent")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tasks", default="", help="comma-separated task ids (default: the server's, see --limit)")
    parser.add_argument("--limit", type=int, default=None, help="first N of the server's task ids")
    parser.add_argument("--seeds", default="", help="comma-separated reset seeds (TurnBandit: a seed is a task)")
    args = parser.parse_args()
    seeds: list[int | None] = [int(seed) for seed in args.seeds.split(",") if seed.strip()] or [None]
    task_ids: list[str | None] = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not task_ids:
        task_ids = [None] if args.seeds and args.limit is None else served_task_ids(args.url)[: args.limit]
    written = asyncio.run(rows(args.url, args.agent, task_ids, seeds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in written))
    print(f"prepare_data: {len(written)} rows in {args.out}")


if __name__ == "__main__":
    main()
