"""Raw upstream wheel build vs. the distribution build, side by side (``nox -s bench -- build``)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .fetch import obtain_pinned_sdist
from .patchset import load_patch_set
from .pipeline import BuildInputs, build_distribution
from .pristine import sdist_epoch, unpack_sdist
from .progress import Silent
from .wheel import build_wheel


def raw_upstream_build(sdist: Path, name: str, version: str, workdir: Path) -> float:
    """Unpack the same sdist and build it with no patches and no overlay; return seconds."""
    t0 = time.perf_counter()
    tree = unpack_sdist(sdist, workdir / "src", f"{name}-{version}")
    build_wheel(tree, version, sdist_epoch(sdist), workdir / "out", workdir / "raw.log")
    return time.perf_counter() - t0


def bench_build(inputs: BuildInputs, rounds: int = 3) -> dict[str, float]:
    pin = load_patch_set(inputs.patch_set_dir).pin
    sdist = obtain_pinned_sdist(pin, inputs.cache, inputs.sdist, print)
    inputs.work_root.mkdir(parents=True, exist_ok=True)
    raw_times, dist_times = [], []
    with tempfile.TemporaryDirectory(prefix="bench-", dir=inputs.work_root) as tmp:
        tmp_path = Path(tmp)
        print("warm-up: one distribution build so the sdist and pristine caches are warm")
        warm = BuildInputs(**{**inputs.__dict__, "dist_dir": tmp_path / "warm"})
        build_distribution(warm, Silent())
        for i in range(rounds):
            round_dir = tmp_path / f"round{i}"
            raw_times.append(raw_upstream_build(sdist, pin.name, pin.version, round_dir / "raw"))
            t0 = time.perf_counter()
            build_distribution(BuildInputs(**{**inputs.__dict__, "dist_dir": round_dir / "dist"}), Silent())
            dist_times.append(time.perf_counter() - t0)
            print(
                f"round {i + 1}: raw upstream {raw_times[-1]:.1f}s, distribution {dist_times[-1]:.1f}s, "
                f"ratio {dist_times[-1] / raw_times[-1]:.2f}"
            )
            shutil.rmtree(round_dir, ignore_errors=True)
    # Disk speed on shared machines swings by 2x between runs; the median of paired
    # rounds is steadier than either extreme.
    raw, dist = statistics.median(raw_times), statistics.median(dist_times)
    result = {"raw_upstream_s": raw, "distribution_warm_s": dist, "ratio": dist / raw}
    print(f"raw upstream wheel build (unpack + build, median of {rounds}): {raw:.1f}s")
    print(f"distribution build, warm cache (median of {rounds}):          {dist:.1f}s")
    print(f"ratio distribution/raw: {result['ratio']:.2f} (goal <= 1.5)")
    return result
