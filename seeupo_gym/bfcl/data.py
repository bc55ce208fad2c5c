"""BFCL v4 multi-turn data: entries, ground truth, function docs and the train/test split.

Everything is read from the data that ships inside `bfcl-eval` (`bfcl_eval/data/`), once per
process per category (`functools.cache`), so building an env or resetting it never re-reads
JSON. Only `bfcl_eval`'s package root is imported here: it is empty and creates no folders.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")
SPLITS: tuple[str, ...] = ("train", "test", "all", "paper-train", "paper-test")

# Which function-doc file documents which backend class (bfcl_eval.constants has the same map,
# but its package also holds modules that create folders on import; this one is data).
_FUNC_DOC_FILES: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}

# The split: per category, ids sorted by number, shuffled with random.Random(f"{SPLIT_SEED}:{category}"),
# the first TEST_SIZE are the test set. `split.json` holds the result so papers can cite the ids;
# tests check that it matches this derivation.
SPLIT_SEED = "seeupo-bfcl-v4-split-v1"
TEST_SIZE = 100
_SPLIT_FILE = Path(__file__).with_name("split.json")

# The SeeUPO paper's split (arXiv 2602.06554), as its authors' code makes it: AgentEvolver, branch
# `seeupo` (commit 9e98eda, "Initial SeeUPO snapshot"), env_service/environments/bfcl/bfcl_dataprocess.py
# with train_ratio 0.5 and no shuffle, saved as external/bfcl/data/BFCL_v4_multi_turn_base_{train,test}
# .parquet: multi_turn_base entries 0-99 train, 100-199 test (read from those files). Base only.
PAPER_SPLIT = {"paper-train": range(0, 100), "paper-test": range(100, 200)}


class BFCLDataError(RuntimeError):
    """The BFCL data is missing or not what this package expects."""


@dataclass(frozen=True)
class FunctionDoc:
    """One function as BFCL documents it (JSON-schema-like, with BFCL's own "dict" type)."""

    name: str
    class_name: str
    description: str
    parameters: Mapping[str, Any]
    response: Mapping[str, Any]


@dataclass(frozen=True)
class Entry:
    """One BFCL multi-turn entry with its ground truth.

    user_messages[i] is the user's message that opens turn i; it is "" for the turns of
    miss_func where the held-back functions are revealed (`revealed_functions[i]`).
    """

    id: str
    category: str
    user_messages: tuple[str, ...]
    initial_config: Mapping[str, Any]
    involved_classes: tuple[str, ...]
    revealed_functions: Mapping[int, tuple[str, ...]]
    ground_truth: tuple[tuple[str, ...], ...]
    # The entry as BFCL's checker reads it (id, initial_config, involved_classes). Read-only by
    # convention: the checker deep-copies what it uses.
    raw: Mapping[str, Any]

    @property
    def num_user_turns(self) -> int:
        return len(self.user_messages)

    @property
    def min_responses(self) -> int:
        """Fewest responses that can finish the entry: one call list per turn with expected calls,
        plus one turn-ending response per turn."""
        return self.num_user_turns + sum(1 for calls in self.ground_truth if calls)

    @property
    def long_context(self) -> bool:
        return self.category == "long_context"


def data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BFCLDataError(
            "bfcl-eval is not installed. Install it without its heavy dependencies: "
            "`pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0` (or `make venv`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not path.is_dir():
        raise BFCLDataError(f"bfcl-eval is installed but has no data folder at {path}; reinstall it.")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    try:
        with path.open(encoding="utf-8") as lines:
            return [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        raise BFCLDataError(f"BFCL data file {path} is missing; reinstall bfcl-eval==2026.3.23.") from None


def category_of(task_id: str) -> str:
    """'multi_turn_miss_func_12' -> 'miss_func'."""
    prefix = "multi_turn_"
    stem = task_id.rsplit("_", 1)[0]
    if not task_id.startswith(prefix) or stem[len(prefix):] not in CATEGORIES:
        raise ValueError(f"{task_id!r} is not a BFCL v4 multi-turn id like 'multi_turn_base_0'")
    return stem[len(prefix):]


@functools.cache
def function_docs() -> Mapping[str, tuple[FunctionDoc, ...]]:
    """Class name -> its documented functions, in BFCL's order."""
    docs: dict[str, tuple[FunctionDoc, ...]] = {}
    for class_name, file_name in _FUNC_DOC_FILES.items():
        docs[class_name] = tuple(
            FunctionDoc(
                name=doc["name"],
                class_name=class_name,
                description=doc.get("description", ""),
                parameters=doc.get("parameters", {}),
                response=doc.get("response", {}),
            )
            for doc in _read_jsonl(data_dir() / "multi_turn_func_doc" / file_name)
        )
    return MappingProxyType(docs)


@functools.cache
def load_category(category: str) -> tuple[Entry, ...]:
    """All 200 entries of a category, in file order."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose from {list(CATEGORIES)}")
    file_name = f"BFCL_v4_multi_turn_{category}.json"
    questions = _read_jsonl(data_dir() / file_name)
    answers = {row["id"]: row["ground_truth"] for row in _read_jsonl(data_dir() / "possible_answer" / file_name)}
    entries = []
    for raw in questions:
        if raw["id"] not in answers:
            raise BFCLDataError(f"{raw['id']} has no ground truth in possible_answer/{file_name}")
        unknown = set(raw["involved_classes"]) - set(_FUNC_DOC_FILES)
        if unknown:
            raise BFCLDataError(f"{raw['id']} uses backends this env does not know: {sorted(unknown)}")
        messages = []
        for turn in raw["question"]:
            # Every turn has one user message, except miss_func's reveal turns, which have none.
            messages.append("\n\n".join(message["content"] for message in turn if message["role"] == "user"))
        revealed = {int(turn): tuple(names) for turn, names in raw.get("missed_function", {}).items()}
        ground_truth = tuple(tuple(calls) for calls in answers[raw["id"]])
        if len(ground_truth) != len(messages):
            raise BFCLDataError(f"{raw['id']}: {len(messages)} user turns but {len(ground_truth)} ground-truth turns")
        entries.append(
            Entry(
                id=raw["id"],
                category=category,
                user_messages=tuple(messages),
                initial_config=raw["initial_config"],
                involved_classes=tuple(raw["involved_classes"]),
                revealed_functions=MappingProxyType(revealed),
                ground_truth=ground_truth,
                raw=raw,
            )
        )
    return tuple(entries)


@functools.cache
def _category_index(category: str) -> Mapping[str, Entry]:
    return MappingProxyType({entry.id: entry for entry in load_category(category)})


def get_entry(task_id: str) -> Entry:
    entry = _category_index(category_of(task_id)).get(task_id)
    if entry is None:
        raise ValueError(f"no BFCL entry {task_id!r} in bfcl-eval's data")
    return entry


def derive_test_ids(category: str) -> list[str]:
    """The test ids of a category, recomputed from SPLIT_SEED (what split.json records)."""
    ids = sorted((entry.id for entry in load_category(category)), key=lambda task_id: int(task_id.rsplit("_", 1)[1]))
    random.Random(f"{SPLIT_SEED}:{category}").shuffle(ids)
    return sorted(ids[:TEST_SIZE], key=lambda task_id: int(task_id.rsplit("_", 1)[1]))


@functools.cache
def _split_file() -> Mapping[str, tuple[str, ...]]:
    with _SPLIT_FILE.open(encoding="utf-8") as handle:
        recorded = json.load(handle)
    return MappingProxyType({category: tuple(recorded["test"][category]) for category in CATEGORIES})


def task_ids(categories: tuple[str, ...] | list[str] = ("base",), split: str = "train") -> list[str]:
    """Ids of the chosen categories and split, in file order (category by category)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    chosen: list[str] = []
    for category in categories:
        entries = load_category(category)
        if split == "all":
            chosen += [entry.id for entry in entries]
            continue
        if split in PAPER_SPLIT:
            if category != "base":
                raise ValueError(f"split {split!r} (the SeeUPO paper's) has base entries only, not {category!r}")
            numbers = PAPER_SPLIT[split]
            chosen += [entry.id for entry in entries if int(entry.id.rsplit("_", 1)[1]) in numbers]
            continue
        test = set(_split_file()[category])
        chosen += [entry.id for entry in entries if (entry.id in test) == (split == "test")]
    return chosen


def write_split_file(path: Path = _SPLIT_FILE) -> None:
    """Regenerate split.json (maintainers only: the split is part of the published results)."""
    payload = {
        "description": "BFCL v4 multi-turn test ids per category for seeupo-gym; every other id is train.",
        "seed": SPLIT_SEED,
        "test_size_per_category": TEST_SIZE,
        "test": {category: derive_test_ids(category) for category in CATEGORIES},
    }
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
