"""What a codec costs per call on one gradient-sized buffer (issue 8), optionally
side by side with the codecs of another git revision.

Times, on a flat float32 vector of ``--size`` values (default 5.8M, the wide MLP of
``benchmarks/communication.py``): ``encode``, ``decode`` and an error-feedback
``encode`` (what a worker does per step: add the residual, encode, decode, keep
what was lost), at several gradient magnitudes, since NumPy's float16 cast slows
down by ~25x on values in float16's subnormal range. Cases are interleaved
(``--repeats`` rounds of every case); figures are the median and minimum in ms.

Usage: ``python benchmarks/codec_speed.py [--against main] [--size 5800000]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

CODECS = ("fp16", "bf16", "int8", "topk:0.01")


def load_revision(rev: str):
    """``dasktf.wire.codecs`` as it was at git revision ``rev`` (a module), with
    the ``dasktf.wire.halfcast`` of that revision under it."""
    root = os.path.join(os.path.dirname(__file__), "..")
    folder = tempfile.mkdtemp()

    def load(name: str):
        src = subprocess.run(
            ["git", "show", f"{rev}:dasktf/{name}.py"], cwd=root, check=True,
            capture_output=True, text=True,
        ).stdout
        path = os.path.join(folder, f"{name}_{rev.replace('/', '_')}.py")
        with open(path, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location(f"_{name}_{rev}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    current = sys.modules.get("dasktf.wire.halfcast")
    sys.modules["dasktf.wire.halfcast"] = load("_halfcast")  # what its compression imports
    try:
        return load("compression")
    finally:
        if current is None:
            del sys.modules["dasktf.wire.halfcast"]
        else:
            sys.modules["dasktf.wire.halfcast"] = current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=5_800_000)
    parser.add_argument("--against", default=None, help="a git revision to compare with")
    parser.add_argument("--scales", default="1,1e-3,1e-4,1e-6")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from dasktf.wire import codecs as compression

    versions = {"this tree": compression}
    if args.against:
        versions[args.against] = load_revision(args.against)
    rng = np.random.default_rng(0)
    base = rng.standard_normal(args.size).astype(np.float32)
    times: dict[tuple, list[float]] = {}
    cases = []
    for scale in (float(s) for s in args.scales.split(",")):
        x = base * np.float32(scale)
        for codec in CODECS:
            for label, mod in versions.items():
                c = mod.get_codec(codec)
                e = c.encode(x)
                fb = mod.ErrorFeedback(c)
                fb.encode(x)
                cases += [
                    ((scale, codec, "encode", label), lambda c=c, x=x: c.encode(x)),
                    ((scale, codec, "decode", label), lambda m=mod, e=e: m.decode(e)),
                    ((scale, codec, "EF encode", label), lambda fb=fb, x=x: fb.encode(x)),
                ]
    with np.errstate(all="ignore"):  # the old float16 cast warns on underflow
        for _ in range(args.repeats):
            for key, fn in cases:
                t = time.perf_counter()
                fn()
                times.setdefault(key, []).append((time.perf_counter() - t) * 1e3)
    labels = list(versions)
    head = " | ".join(f"{lab} ms (min)" for lab in labels)
    print(f"{args.size:,} float32 values; median (min) of {args.repeats} interleaved calls\n")
    print(f"| scale | codec | call | {head} |" + (" before/after |" if len(labels) > 1 else ""))
    print("|---" * (3 + len(labels) + (len(labels) > 1)) + "|")
    seen = []
    for key, _ in cases:
        row = key[:3]
        if row in seen:
            continue
        seen.append(row)
        med = [float(np.median(times[(*row, lab)])) for lab in labels]
        cells = " | ".join(
            f"{m:.1f} ({min(times[(*row, lab)]):.1f})" for m, lab in zip(med, labels, strict=False)
        )
        ratio = f" {med[1] / med[0]:.1f}x |" if len(labels) > 1 else ""
        print(f"| {row[0]:g} | {row[1]} | {row[2]} | {cells} |{ratio}")
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)")


if __name__ == "__main__":
    main()
