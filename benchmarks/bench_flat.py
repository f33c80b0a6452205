"""Flat gradients against the per-tensor path, torch.nn.utils and the one-buffer floor.

A plain script, not a test. For 1M float32 gradient entries split into 10, 100, 1,000 and
3,000 equal tensors, and for 10 large tensors of 3M each (30M), it times side by side:

* ``torch``: :mod:`torch.nn.utils` (``get_total_norm``, ``clip_grad_norm_``,
  ``clip_grad_value_``; foreach where torch picks it);
* ``per-tensor``: gradlab's functions on ordinary gradients (one tensor each);
* ``flat``: gradlab's functions given a :class:`gradlab.flat.FlatGrads` (the fast path:
  no walk over the parameters, one kernel per buffer);
* ``flat, list``: gradlab's functions given the plain parameter list whose gradients are
  the flat views (the slow path: the walk, then the views merged into the buffer);
* the floors, over one contiguous buffer of the same size (the flat buffer itself, so
  that where it sits in memory does not count): ``floor_norm``, one
  :func:`torch.linalg.vector_norm` (the issue's floor); ``floor_clip``, that norm, torch's
  coefficient ``min(1, max_norm / (norm + 1e-6))`` and one multiply; ``floor_ignore``,
  that norm, one comparison and one integer multiply of the bits; ``floor_clamp``, one
  clamp; ``floor_ignore_value``, ``aminmax``, one comparison, one integer multiply.

Each family (norm, clip, ignore, clip by value, ignore by value) is one interleaved
comparison against its own floor, with ``floor_norm`` beside it. Targets (issue 23):
the flat norm at 3,000 tensors at most 1.2x ``floor_norm``; flat clip and ignore at most
1.3x their floors; with 10 large tensors flat no slower than per-tensor; the flat
gradients in one storage of exactly their size (no second copy).

A last table times a backward at 3,000 tensors: ordinary gradients (torch's default
``zero_grad()``, and ``set_to_none=False``) against flat ones, with and without the
rebind hooks, zeroed by :meth:`FlatGrads.zero_grad` or by ``optimizer.zero_grad()``
(``set_to_none=True``: each fresh gradient copied back into its view).

Timed by the thread's CPU time over interleaved rounds (benchmarks/harness.py), one
torch thread; cells are µs per call, ratios min/min and paired (the median of the
rounds' ratios).

    .venv/bin/python benchmarks/bench_flat.py [--rounds 40] [--quick] [--json PATH]
    .venv/bin/python benchmarks/bench_flat.py --sets k=3000 --rounds 100   # one set, longer
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from harness import Row, compare, format_rows, setup_threads, write_json
from torch import Tensor, nn

import gradlab
from gradlab.flat import FlatGrads

HIGH = 1e9  # above every norm and entry: each call does the work of a healthy step
SETS = {
    "k=10": (10, 1_000_000),
    "k=100": (100, 1_000_000),
    "k=1000": (1000, 1_000_000),
    "k=3000": (3000, 1_000_000),
    "10 large (30M)": (10, 30_000_000),
}


def make_params(k: int, total: int, seed: int = 0) -> list[nn.Parameter]:
    """``k`` float32 parameters of ``total`` entries in all, with seeded gradients."""
    sizes = [total // k] * k
    sizes[-1] += total - sum(sizes)
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n, generator=gen) * 1e-3
        params.append(p)
    return params


def grad_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the distinct storages that hold the gradients."""
    storages = {
        p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
        for p in params
        if p.grad is not None
    }
    return sum(storages.values())


def floors(buffer: Tensor) -> dict:
    """The one-buffer floors of each family (the buffer is left as it is: nothing is
    clipped, the bits are multiplied by 1)."""
    bits = buffer.view(torch.int32)
    bound = torch.tensor(HIGH)

    def clip() -> None:
        norm = torch.linalg.vector_norm(buffer)
        buffer.mul_(torch.clamp(HIGH / (norm + 1e-6), max=1.0))

    def ignore() -> None:
        bits.mul_(torch.le(torch.linalg.vector_norm(buffer), bound).to(torch.int32))

    def ignore_value() -> None:
        low, high = torch.aminmax(buffer)
        keep = torch.maximum(high, low.neg()) < bound
        bits.mul_(keep.to(torch.int32))

    return {
        "floor_norm": lambda: torch.linalg.vector_norm(buffer),
        "floor_clip": clip,
        "floor_ignore": ignore,
        "floor_clamp": lambda: buffer.clamp_(-HIGH, HIGH),
        "floor_ignore_value": ignore_value,
    }


def families(k: int, total: int) -> dict[str, tuple[str, dict]]:
    """family -> (its floor, name -> call), for one parameter set."""
    plain = make_params(k, total)
    listed = make_params(k, total)  # the same values, made flat
    flat = FlatGrads(listed)
    grads = [p.grad for p in plain]
    # The floors run on the flat buffer itself (they leave its values as they are): a
    # buffer elsewhere in memory measured 5-20% apart on this machine (placement, not work).
    floor = floors(flat.buffers[0])
    base = {"floor_norm": floor["floor_norm"]}
    u, g = torch.nn.utils, gradlab
    return {
        "norm": (
            "floor_norm",
            {
                **base,
                "torch": lambda: u.get_total_norm(grads),
                "per-tensor": lambda: g.get_total_norm(grads),
                "flat": lambda: g.get_total_norm(flat),
                "flat, list": lambda: g.get_total_norm([p.grad for p in listed]),
            },
        ),
        "clip": (
            "floor_clip",
            {
                **base,
                "floor_clip": floor["floor_clip"],
                "torch": lambda: u.clip_grad_norm_(plain, HIGH),
                "per-tensor": lambda: g.clip_grad_norm_(plain, HIGH),
                "flat": lambda: g.clip_grad_norm_(flat, HIGH),
                "flat, list": lambda: g.clip_grad_norm_(listed, HIGH),
            },
        ),
        "ignore": (
            "floor_ignore",
            {
                **base,
                "floor_ignore": floor["floor_ignore"],
                "per-tensor": lambda: g.grad_ignore_norm_(plain, HIGH),
                "flat": lambda: g.grad_ignore_norm_(flat, HIGH),
                "flat, list": lambda: g.grad_ignore_norm_(listed, HIGH),
            },
        ),
        "clip_value": (
            "floor_clamp",
            {
                **base,
                "floor_clamp": floor["floor_clamp"],
                "torch": lambda: u.clip_grad_value_(plain, HIGH),
                "per-tensor": lambda: g.clip_grad_value_(plain, HIGH),
                "flat": lambda: g.clip_grad_value_(flat, HIGH),
                "flat, list": lambda: g.clip_grad_value_(listed, HIGH),
            },
        ),
        "ignore_value": (
            "floor_ignore_value",
            {
                **base,
                "floor_ignore_value": floor["floor_ignore_value"],
                "per-tensor": lambda: g.grad_ignore_value_(plain, HIGH),
                "flat": lambda: g.grad_ignore_value_(flat, HIGH),
                "flat, list": lambda: g.grad_ignore_value_(listed, HIGH),
            },
        ),
    }


def memory_note(k: int, total: int) -> str:
    """The flat gradients' storage against their size, and the ordinary ones'."""
    plain = make_params(k, total)
    before = grad_bytes(plain)
    flat = FlatGrads(plain)
    after = grad_bytes(plain)
    one = {p.grad.untyped_storage().data_ptr() for p in plain}
    if after != total * 4 or len(one) != 1 or flat.numel != total:
        raise AssertionError(f"flat gradients: {after} bytes in {len(one)} storages")
    return f"gradient storage: {before} B in {k} storages -> {after} B in 1 (exactly their size)"


def backward_variants(k: int, total: int) -> dict:
    """One backward of a loss touching ``k`` parameters, after each way of zeroing."""
    weights = torch.randn(total // k)

    def setup(flat_mode: str | None):
        params = make_params(k, total)
        opt = torch.optim.SGD(params, lr=0.0)
        flat = None if flat_mode is None else FlatGrads(params, rebind=flat_mode == "rebind")

        def backward() -> None:
            loss = sum((p[: weights.numel()] * weights).sum() for p in params)
            loss.backward()  # type: ignore[union-attr]

        return opt, flat, backward

    opt1, _, bw1 = setup(None)
    opt2, _, bw2 = setup(None)
    _, flat3, bw3 = setup("rebind")
    _, flat4, bw4 = setup("plain")
    opt5, _, bw5 = setup("rebind")
    assert flat3 is not None and flat4 is not None
    return {
        "ordinary, zero_grad()": lambda: (opt1.zero_grad(), bw1()),
        "ordinary, zero_grad(set_to_none=False)": lambda: (opt2.zero_grad(False), bw2()),
        "flat rebind=True, flat.zero_grad()": lambda: (flat3.zero_grad(), bw3()),
        "flat rebind=False, flat.zero_grad()": lambda: (flat4.zero_grad(), bw4()),
        "flat rebind=True, zero_grad() (copies)": lambda: (opt5.zero_grad(), bw5()),
    }


def check_targets(tables: dict[str, list[Row]]) -> list[str]:
    def row(table: str, name: str) -> Row:
        return next(r for r in tables[table] if r.name == name)

    lines = []
    checks = [
        ("k=3000 norm", "flat", "floor_norm", 1.2),
        ("k=3000 clip", "flat", "floor_clip", 1.3),
        ("k=3000 ignore", "flat", "floor_ignore", 1.3),
    ]
    for table, name, floor, target in checks:
        if table not in tables:
            continue
        r, f = row(table, name), row(table, floor)
        ratio = r.min_us / f.min_us
        verdict = "met" if ratio <= target else "NOT met"
        lines.append(f"{table}: flat / {floor} = {ratio:.3f} (target <= {target}): {verdict}")
    for family in ("norm", "clip", "ignore"):
        table = f"10 large (30M) {family}"
        if table in tables:
            ratio = row(table, "flat").min_us / row(table, "per-tensor").min_us
            verdict = "met" if ratio <= 1.05 else "NOT met"
            lines.append(f"{table}: flat / per-tensor = {ratio:.3f} (no regression): {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per table")
    parser.add_argument("--quick", action="store_true", help="10 rounds, no 30M set")
    parser.add_argument(
        "--block-ms",
        type=float,
        default=20.0,
        help="length of a timed block (default 20): the first call of a block finds the "
        "caches cold after a per-tensor variant, and weighs less in a longer block",
    )
    parser.add_argument("--json", default=None, help="write every table to this JSON file")
    parser.add_argument(
        "--sets", default=None, help=f"comma-separated sets to run (default: all of {list(SETS)})"
    )
    args = parser.parse_args()
    setup_threads(1)
    rounds = 10 if args.quick else args.rounds
    chosen = list(SETS) if args.sets is None else [s.strip() for s in args.sets.split(",")]
    unknown = [s for s in chosen if s not in SETS]
    if unknown:
        parser.error(f"unknown sets {unknown}; choose from {list(SETS)}")
    sets = {k: SETS[k] for k in chosen if not (args.quick and SETS[k][1] > 1_000_000)}
    settings = {
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), 1 torch thread",
        "clock": "thread CPU time, interleaved rounds",
        "rounds": rounds,
        "block_ms": args.block_ms,
        "dtype": "float32",
        "threshold": HIGH,
    }
    print(
        f"torch {torch.__version__}, {settings['machine']}; {rounds} rounds; "
        "µs per call (min, median); ratios min/min and paired"
    )
    tables: dict[str, list[Row]] = {}
    for label, (k, total) in sets.items():
        print(f"\n== {label}: {k} tensors, {total:,} floats; {memory_note(k, total)}")
        for family, (floor, calls) in families(k, total).items():
            r = max(10, rounds // 2) if total > 1_000_000 else rounds
            rows = compare(calls, floor, rounds=r, block_ms=args.block_ms)
            tables[f"{label} {family}"] = rows
            print(format_rows(rows, f"\n{family} (ratios to {floor})"))
    if args.sets is None:
        k, total = 3000, 1_000_000
        rows = compare(
            backward_variants(k, total), "ordinary, zero_grad()", rounds=max(10, rounds // 2)
        )
        tables["backward k=3000"] = rows
        print(format_rows(rows, f"\nbackward, {k} tensors (ratios to torch's default)"))
    print("\nTargets (issue 23):")
    for line in check_targets(tables):
        print("  " + line)
    if args.json:
        write_json(args.json, tables, settings)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
