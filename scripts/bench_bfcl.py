"""Benchmark seeupo/BFCL-v4-v0: import time, step overhead vs BFCL's executor, replay speed, memory.

    .venv/bin/python scripts/bench_bfcl.py [--memory-episodes 1000]

Prints:
- how many entries per category can finish within 10 responses at all (one call list per turn
  with expected calls + one turn-ending reply per turn);
- import / first-env times (fresh interpreters);
- step overhead: env.step on each ground-truth call list vs BFCL's own
  `execute_multi_turn_func_call` on the same calls (backends already built in both);
- ground-truth replay episodes per second through gym.make (the checker included);
- RSS growth over N replayed episodes after a warm-up;
- adversarial responses: step time and the time of the final step (BFCL's checker replays the
  calls) for the responses that used to take seconds, and for calls at the argument bounds;
- the slowest single call of every backend function with each argument at its bound.

`--adversarial-only` runs the last two (also against an older checkout via PYTHONPATH).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import subprocess
import sys
import time
import uuid

import gymnasium as gym
import psutil

import seeupo_gym  # noqa: F401
from seeupo_gym.bfcl import CATEGORIES, get_entry, load_category, render_action, render_turn_end, task_ids
from seeupo_gym.bfcl.data import function_docs

# Entries whose backends cover every class: base_15 has MathAPI and GorillaFileSystem.
_ENTRY_PER_CLASS = {"GorillaFileSystem": "multi_turn_base_0", "TwitterAPI": "multi_turn_base_0",
                    "TicketAPI": "multi_turn_base_2", "MessageAPI": "multi_turn_base_14",
                    "MathAPI": "multi_turn_base_15", "VehicleControlAPI": "multi_turn_base_50",
                    "TradingBot": "multi_turn_base_100", "TravelAPI": "multi_turn_base_150"}
_BIG_INT = "9" * 20  # the largest integer literal the env accepts has 20 digits


def adversarial_responses() -> dict[str, str]:
    """Responses that cost seconds before the bounds, and the costliest ones within them."""
    huge = "9" * 4299  # just under CPython's int -> str limit, so it parses
    return {
        "power, 4299-digit base": f"[power(base={huge}, exponent=1000)]",
        "7 x power, 4299-digit base": "[" + ", ".join([f"power(base={huge}, exponent=1000)"] * 7) + "]",
        "add, 0x + 4000 hex digits": f"[add(a=0x{'f' * 4000}, b=1)]",
        "64 x power at the bounds": "[" + ", ".join([f"power(base={_BIG_INT}, exponent=1000)"] * 64) + "]",
        "64 x logarithm, precision 1000": "[" + ", ".join(["logarithm(value=7, base=3, precision=1000)"] * 64) + "]",
        "64 x square_root, precision 1000": "[" + ", ".join([f"square_root(number={_BIG_INT}, precision=1000)"] * 64) + "]",
        "standard_deviation of 1400 big ints": f"[standard_deviation(numbers=[{', '.join([_BIG_INT] * 1400)}])]",
    }


def adversarial_steps() -> None:
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000)
    entry = get_entry("multi_turn_base_15")
    for name, action in adversarial_responses().items():
        env.reset(options={"task_id": entry.id})
        start = time.perf_counter()
        try:
            *_, info = env.step(f"<think>x</think>\n{action}")
            outcome = f"{info['action_kind']}, {len(info['calls'])} calls ran"
        except Exception as error:  # what the env did before the bounds: report, do not stop
            outcome = f"step raised {type(error).__name__}"
        step_seconds = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(entry.num_user_turns):
            env.step(render_turn_end("Done."))
        check_seconds = time.perf_counter() - start
        print(f"  {name:38s} step {step_seconds:7.3f} s ({outcome}); final step with the checker {check_seconds:7.3f} s")

    # The costliest episode within the default 10 responses: 5 responses of 64 logarithms at
    # precision 1000 (each replayed by the checker, which on failure also replays every prefix).
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all")
    env.reset(options={"task_id": entry.id})
    logarithms = "[" + ", ".join(["logarithm(value=7, base=3, precision=1000)"] * 64) + "]"
    slowest_step = 0.0
    for action in [logarithms, "Done."] * entry.num_user_turns:
        start = time.perf_counter()
        env.step(f"<think>x</think>\n{action}")
        slowest_step = max(slowest_step, time.perf_counter() - start)
    print(f"  10 responses, 5 x 64 logarithms, failing check: slowest step {slowest_step:.3f} s")


def _bound_values(kind: str) -> list[str]:
    if kind in ("integer", "int"):
        return [_BIG_INT, "-" + _BIG_INT]
    if kind in ("float", "number"):
        return ["1e308", "-1e308", _BIG_INT]
    if kind == "array":
        return ["[" + ", ".join([_BIG_INT] * 1400) + "]", "[" + ", ".join(["'x'"] * 6000) + "]"]
    if kind == "dict":
        return ["{" + ", ".join(f"'k{i}': 'v'" for i in range(2500)) + "}"]
    if kind == "boolean":
        return ["True"]
    return [repr("x" * 30_000), repr("a\n" * 15_000)]


def slowest_calls(top: int = 5) -> None:
    """Each function once per argument at a bound (the others small); the slowest steps."""
    env = gym.make("seeupo/BFCL-v4-v0", categories=["base"], split="all", max_turns=1_000_000)
    timings = []
    for class_name, task_id in _ENTRY_PER_CLASS.items():
        env.reset(options={"task_id": task_id})
        for doc in function_docs()[class_name]:
            properties = doc.parameters.get("properties", {})
            small = {name: _bound_values(schema.get("type", "string"))[0][:8] or "1" for name, schema in properties.items()}
            for name, schema in properties.items():
                for value in _bound_values(schema.get("type", "string")):
                    args = ", ".join(f"{key}={value if key == name else small_value}" for key, small_value in small.items())
                    start = time.perf_counter()
                    env.step(f"<think>x</think>\n[{doc.name}({args})]")
                    timings.append((time.perf_counter() - start, f"{doc.name}({name}=<{len(value)} chars>)"))
    timings.sort(reverse=True)
    print(f"  {len(timings)} calls; slowest: " + "; ".join(f"{label} {1e3 * seconds:.1f} ms" for seconds, label in timings[:top]))


def fresh_interpreter_seconds(code: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        best = min(best, time.perf_counter() - start)
    return best


def completable_within(limit: int, split: str = "all") -> dict[str, str]:
    counts = {}
    for category in CATEGORIES:
        ids = set(task_ids([category], split))
        entries = [entry for entry in load_category(category) if entry.id in ids]
        counts[category] = f"{sum(entry.min_responses <= limit for entry in entries)}/{len(entries)}"
    return counts


def replay_script(entry) -> list[str]:
    actions = []
    for calls in entry.ground_truth:
        if calls:
            actions.append(render_action(list(calls)))
        actions.append(render_turn_end("Done."))
    return actions


def step_overhead(rounds: int) -> tuple[float, float, int]:
    """Seconds in env.step for call steps vs in BFCL's executor for the same calls (best of rounds)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    env = gym.make("seeupo/BFCL-v4-v0", categories=list(CATEGORIES), split="all", max_turns=1_000)
    entries = [entry for category in CATEGORIES for entry in load_category(category)]
    best_env = best_bfcl = float("inf")
    steps = 0
    for _ in range(rounds):
        env_seconds = bfcl_seconds = 0.0
        steps = 0
        for entry in entries:
            env.reset(options={"task_id": entry.id})
            for calls in entry.ground_truth:
                if calls:
                    action = render_action(list(calls))
                    start = time.perf_counter()
                    env.step(action)
                    env_seconds += time.perf_counter() - start
                    steps += 1
                env.step(render_turn_end("Done."))
        for entry in entries:
            model_name = f"bench_{uuid.uuid4().hex}"
            kwargs = dict(
                initial_config=entry.raw["initial_config"],
                involved_classes=list(entry.involved_classes),
                model_name=model_name,
                test_entry_id=entry.id,
                long_context=entry.long_context,
            )
            multi_turn_utils.execute_multi_turn_func_call([], **kwargs)  # builds the instances, untimed
            for calls in entry.ground_truth:
                if calls:
                    start = time.perf_counter()
                    multi_turn_utils.execute_multi_turn_func_call(list(calls), **kwargs)
                    bfcl_seconds += time.perf_counter() - start
            cache = vars(multi_turn_utils)
            for key in [key for key in cache if key.startswith(model_name)]:
                del cache[key]
        best_env, best_bfcl = min(best_env, env_seconds), min(best_bfcl, bfcl_seconds)
    return best_env, best_bfcl, steps


def replay_speed() -> tuple[float, int, int]:
    env = gym.make("seeupo/BFCL-v4-v0", categories=list(CATEGORIES), split="all", max_turns=1_000)
    entries = [entry for category in CATEGORIES for entry in load_category(category)]
    solved = 0
    start = time.perf_counter()
    for entry in entries:
        env.reset(options={"task_id": entry.id})
        for action in replay_script(entry):
            _, reward, terminated, truncated, _ = env.step(action)
        solved += reward == 1.0
    return time.perf_counter() - start, len(entries), solved


def memory_growth(episodes: int, warmup: int = 100) -> tuple[float, float]:
    env = gym.make("seeupo/BFCL-v4-v0", categories=list(CATEGORIES), split="all", max_turns=1_000)
    entries = itertools.cycle([entry for category in CATEGORIES for entry in load_category(category)])
    process = psutil.Process()

    def run(count: int) -> None:
        for entry in itertools.islice(entries, count):
            env.reset(options={"task_id": entry.id})
            for action in replay_script(entry):
                env.step(action)

    run(warmup)
    gc.collect()
    before = process.memory_info().rss / 2**20
    run(episodes)
    gc.collect()
    after = process.memory_info().rss / 2**20
    env.close()
    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-episodes", type=int, default=1_000)
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--adversarial-only", action="store_true")
    args = parser.parse_args()

    print("adversarial responses (base_15: GorillaFileSystem + MathAPI):")
    adversarial_steps()
    print("every backend function with one argument at its bound:")
    slowest_calls()
    if args.adversarial_only:
        return

    for split in ("all", "train", "test"):
        print(f"entries that can finish within 10 responses ({split}):", completable_within(10, split))
    import_seconds = fresh_interpreter_seconds("import seeupo_gym")
    make_seconds = fresh_interpreter_seconds(
        "import gymnasium as gym, seeupo_gym; gym.make('seeupo/BFCL-v4-v0').reset(seed=0)"
    )
    print(f"import seeupo_gym: {import_seconds:.2f} s; import + gym.make + first reset: {make_seconds:.2f} s "
          "(fresh interpreters, best of 3)")

    env_seconds, bfcl_seconds, steps = step_overhead(args.overhead_rounds)
    print(f"call steps: {steps}; env.step {1e6 * env_seconds / steps:.0f} us/step vs BFCL executor "
          f"{1e6 * bfcl_seconds / steps:.0f} us/step; ratio {env_seconds / bfcl_seconds:.2f}")

    seconds, count, solved = replay_speed()
    print(f"ground-truth replay: {count} episodes in {seconds:.2f} s = {count / seconds:.0f} episodes/s "
          f"({solved}/{count} scored 1.0)")

    before, after = memory_growth(args.memory_episodes)
    print(f"memory over {args.memory_episodes} episodes: RSS {before:.1f} -> {after:.1f} MiB "
          f"(growth {after - before:+.1f} MiB)")


if __name__ == "__main__":
    main()
