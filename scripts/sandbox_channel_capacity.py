"""Measure channels between two concurrent AppWorld sandboxes that the sandbox leaves open, in bits/s.

    .venv/bin/python scripts/sandbox_channel_capacity.py [--channel cpu|inodes] [--slots-ms 10,20,50] [--bits 64]
        [--exclusive-steps] [--sandbox bwrap|gvisor]
    .venv/bin/python scripts/sandbox_channel_capacity.py --channel inode-storage [--symbol-bits 4] [--symbols 16]
        [--unit 2048] [--sandbox bwrap|gvisor]

Two real sandboxed servers run one cell each at the same time; the sender, in sandbox A, sends
random bits, one per time slot, and the receiver, in sandbox B, decodes them. Both start at
the same moment of CLOCK_MONOTONIC (one clock for every process on the machine; AppWorld's own
`time` is frozen in cells), given by the host; a preamble of alternating bits sets the
receiver's threshold.

- cpu: for a 1 the sender keeps every CPU busy (one spinning process per CPU), for a 0 it
  sleeps; the receiver counts the iterations of a Python loop it manages in each slot.
- inodes: the inode numbers the kernel gives new pipes and sockets come from one machine-wide
  counter, handed to each CPU in batches of 1024 (`get_next_ino`); for a 1 the sender makes
  pipes, the receiver (pinned to one CPU) reads how many batches other CPUs took in the slot.

- inode-storage: the same counter used as storage, no clock needed: one step of the sender
  makes symbol x `--unit` pipes; a later step of the receiver reads how many batches other
  CPUs took since its previous step (symbol = batches / (unit / 1024), rounded). Steps never
  overlap, so `exclusive_steps` does not close it; only a kernel per sandbox does
  (`--sandbox gvisor`: every reading is the receiver's own, the symbol error rate is chance,
  1 - 2^-bits).

With --exclusive-steps (`SandboxLimits(exclusive_steps=True)`) the two cells cannot run at the
same time: one runs after the other, and what the receiver decodes is what a sender it never
overlaps could pass in real time.

Prints, per slot length, the raw rate, the symbol error rate over the payload and the capacity
of a binary symmetric channel with that error rate, (1 - H(p)) / slot, with the load average.
These are what `README.md`'s "Channels that remain" states; the kernel's counters in files and
`sysinfo` are closed (`seeupo_gym/appworld/worker/limits.py`, `mask_proc`; `seccomp.py`).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import threading
import time

from seeupo_gym.appworld import find_data_dir, find_python
from seeupo_gym.appworld.sandbox import SandboxLimits
from seeupo_gym.appworld.server import AppWorldServer

# A route past AppWorld's guards to the OS, as model code would take (see tests/).
PRELUDE = """
import random, typing
P = random._os.sys.modules['posix']
C = typing.sys.modules['ctypes']
libc = C.CDLL(None, use_errno=True)
class Timespec(C.Structure):
    _fields_ = [('s', C.c_long), ('ns', C.c_long)]
def now(ts=Timespec()):
    libc.clock_gettime(1, C.byref(ts))
    return ts.s + ts.ns * 1e-9
def sleep_until(moment):
    left = moment - now()
    if left > 0:
        libc.usleep(int(left * 1e6))
"""
SEND = PRELUDE + """
bits, start, slot = {bits!r}, {start!r}, {slot!r}
def follow():
    for i, bit in enumerate(bits):
        end = start + (i + 1) * slot
        if bit:
            sleep_until(start + i * slot)
            while now() < end:
                pass
        else:
            sleep_until(end)
kids = []
for _ in range({cpus} - 1):
    pid = P.fork()
    if pid == 0:
        follow()
        P._exit(0)
    kids.append(pid)
follow()
for pid in kids:
    P.waitpid(pid, 0)
print('sent')
"""
RECEIVE = PRELUDE + """
count, start, slot = {count!r}, {start!r}, {slot!r}
margin = slot * 0.1
counts = []
for i in range(count):
    sleep_until(start + i * slot + margin)
    end = start + (i + 1) * slot - margin
    n = 0
    while now() < end:
        for _ in range(200):
            n += 1
    counts.append(n)
print(counts)
"""


# The inode numbers the kernel gives new pipes and sockets come from one machine-wide counter,
# handed to each CPU in batches of 1024 (`get_next_ino`). The sender makes pipes for a 1; the
# receiver, pinned to one CPU, uses up its batch at each end of a slot: the gap between its
# batches is what every other CPU took meanwhile.
SEND_INODES = PRELUDE + """
bits, start, slot = {bits!r}, {start!r}, {slot!r}
for i, bit in enumerate(bits):
    end = start + (i + 1) * slot
    if bit:
        sleep_until(start + i * slot)
        while now() < end:
            for _ in range(64):
                r, w = P.pipe()
                P.close(r); P.close(w)
    else:
        sleep_until(end)
print('sent')
"""
RECEIVE_INODES = PRELUDE + """
count, start, slot = {count!r}, {start!r}, {slot!r}
P.sched_setaffinity(0, {{sorted(P.sched_getaffinity(0))[-1]}})
def next_batch():  # make pipes until one opens a new batch of 1024; that batch's first number
    while True:
        r, w = P.pipe()
        number = P.fstat(r).st_ino
        P.close(r); P.close(w)
        if number % 1024 == 1:
            return number
counts = []
for i in range(count):
    sleep_until(start + i * slot)
    first = next_batch()
    sleep_until(start + (i + 1) * slot - slot * 0.05)
    counts.append(-(next_batch() - first - 1024) // 1024)  # negated: more taken reads as fewer
print(counts)
"""

# The storage form: the receiver's mark is the first number of a new batch on its CPU (as
# above); between two marks, other CPUs took (mark - previous - 1024) / 1024 batches.
MARK_INODES = PRELUDE + """
P.sched_setaffinity(0, {sorted(P.sched_getaffinity(0))[-1]})
def next_batch():
    for _ in range(1 << 16):
        r, w = P.pipe()
        number = P.fstat(r).st_ino
        P.close(r); P.close(w)
        if number % 1024 == 1:
            return number
    return number
print(next_batch())
"""
STORE_INODES = PRELUDE + """
for _ in range({pipes}):
    r, w = P.pipe()
    P.close(r); P.close(w)
print('sent')
"""


def measure_storage(sender: AppWorldServer, receiver: AppWorldServer, symbols: list[int], bits: int,
                    unit: int = 2048) -> tuple[list[int], list[int], float]:
    """Send `symbols` (each < 2**bits) through the inode counter, one sender step each, read
    by the receiver's next step. Returns (decoded symbols, raw batch counts, seconds taken)."""
    def mark() -> int:
        output = receiver.execute(MARK_INODES, timeout=60).strip()
        if not output.isdigit():
            raise RuntimeError(f"the receiver failed: {output[-2000:]}")
        return int(output)

    began = time.monotonic()
    decoded, taken = [], []
    previous = mark()
    for symbol in symbols:
        sent = sender.execute(STORE_INODES.format(pipes=symbol * unit), timeout=120).strip()
        if sent != "sent":
            raise RuntimeError(f"the sender failed: {sent[-2000:]}")
        now = mark()
        batches = max(0, (now - previous - 1024) // 1024)
        previous = now
        taken.append(batches)
        decoded.append(min(2**bits - 1, round(batches / (unit / 1024))))
    return decoded, taken, time.monotonic() - began


def entropy(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def measure(sender: AppWorldServer, receiver: AppWorldServer, slot: float, payload: list[int],
            preamble: list[int], channel: str = "cpu") -> tuple[float, int]:
    bits = preamble + payload
    start = time.monotonic() + 4.0  # both cells are running by then
    timeout = 4.0 + slot * len(bits) + 60
    sent: list[str] = []
    send, receive = (SEND, RECEIVE) if channel == "cpu" else (SEND_INODES, RECEIVE_INODES)
    thread = threading.Thread(target=lambda: sent.append(sender.execute(
        send.format(bits=bits, start=start, slot=slot, cpus=os.cpu_count() or 1), timeout=timeout)))
    thread.start()
    try:
        output = receiver.execute(receive.format(count=len(bits), start=start, slot=slot), timeout=timeout)
    finally:
        thread.join()
    if not sent or sent[0].strip() != "sent":
        raise RuntimeError(f"the sender failed: {sent}")
    if not output.strip().startswith("["):
        raise RuntimeError(f"the receiver failed: {output[-2000:]}")
    counts = [int(n) for n in output.strip().strip("[]").split(",")]
    ones = [c for c, b in zip(counts, preamble) if b]
    zeros = [c for c, b in zip(counts, preamble) if not b]
    threshold = (sum(ones) / len(ones) + sum(zeros) / len(zeros)) / 2
    low_is_one = sum(ones) / len(ones) < sum(zeros) / len(zeros)
    decoded = [int((c < threshold) == low_is_one) for c in counts[len(preamble):]]
    errors = sum(d != b for d, b in zip(decoded, payload))
    return errors / len(payload), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots-ms", default="50,100,200", help="slot lengths to try, in ms")
    parser.add_argument("--bits", type=int, default=64, help="payload bits per slot length")
    parser.add_argument("--preamble", type=int, default=16, help="alternating bits to set the threshold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channel", choices=("cpu", "inodes", "inode-storage"), default="cpu",
                        help="cpu: contention timed on CLOCK_MONOTONIC; inodes: the pipe inode counter in real "
                             "time; inode-storage: the same counter, one step leaves, a later step reads")
    parser.add_argument("--exclusive-steps", action="store_true",
                        help="the sandboxes' steps one at a time (SandboxLimits(exclusive_steps=True))")
    parser.add_argument("--sandbox", choices=("bwrap", "gvisor"), default="bwrap")
    parser.add_argument("--symbol-bits", type=int, default=4, help="inode-storage: bits per symbol")
    parser.add_argument("--symbols", type=int, default=16, help="inode-storage: symbols to send")
    parser.add_argument("--unit", type=int, default=2048, help="inode-storage: pipes per symbol step")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    data = find_data_dir("mini")
    limits = SandboxLimits(exclusive_steps=args.exclusive_steps)
    servers = [AppWorldServer(find_python(), data, sandbox=args.sandbox, limits=limits) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
              f"exclusive_steps={args.exclusive_steps}; sandbox={args.sandbox}")
        if args.channel == "inode-storage":
            for server in servers:
                server.open_episode("mininote_1", timeout_seconds=600, max_interactions=10 * args.symbols)
            symbols = [rng.randrange(2**args.symbol_bits) for _ in range(args.symbols)]
            decoded, taken, seconds = measure_storage(servers[0], servers[1], symbols, args.symbol_bits, args.unit)
            errors = sum(d != s for d, s in zip(decoded, symbols))
            print(f"sent     {symbols}\ndecoded  {decoded}\nbatches  {taken}")
            print(f"{args.symbol_bits}-bit symbols: {errors}/{len(symbols)} symbol errors "
                  f"(chance: {1 - 2**-args.symbol_bits:.3f}), {len(set(decoded))} distinct readings, "
                  f"{args.symbol_bits * len(symbols) / seconds:.2f} raw bit/s over {seconds:.1f} s; "
                  f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            return
        print("slot_ms  raw_bit/s  errors  symbol_error_rate  capacity_bit/s  load_1m")
        for slot_ms in (float(x) for x in args.slots_ms.split(",")):
            payload = [rng.randrange(2) for _ in range(args.bits)]
            preamble = [i % 2 for i in range(args.preamble)]
            for server in servers:
                server.close_episode(collect=False)
                server.open_episode("mininote_1", timeout_seconds=600, max_interactions=50)
            slot = slot_ms / 1000
            rate, errors = measure(servers[0], servers[1], slot, payload, preamble, args.channel)
            capacity = (1 - entropy(rate)) / slot  # symmetric: a receiver that reads inverted bits flips them
            print(f"{slot_ms:7.0f}  {1 / slot:9.1f}  {errors:3d}/{len(payload):<3d} {rate:17.3f}  {capacity:14.2f}  "
                  f"{os.getloadavg()[0]:7.2f}")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for server in servers:
            server.shutdown()


if __name__ == "__main__":
    main()
