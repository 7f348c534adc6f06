"""Command line of the builder: ``python -m ascend_builder <command>`` (nox calls this)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import REPO_ROOT, cache_dir, load_config
from .errors import BuildError


def _sdist_arg(value: str | None) -> Path | None:
    value = value or os.environ.get("VLLM_ASCEND_SDIST")
    return Path(value).expanduser().resolve() if value else None


def cmd_build(args) -> int:
    from .pipeline import BuildInputs, build_distribution

    cfg = load_config(args.root, patch_set=args.patch_set)
    inputs = BuildInputs.from_config(
        cfg,
        dist_dir=Path(args.dist_dir) if args.dist_dir else None,
        sdist=_sdist_arg(args.sdist),
        keep_work=args.keep_work,
    )
    build_distribution(inputs)
    return 0


def cmd_patches(args) -> int:
    from .export import freshness_problems
    from .patchset import lint_patch_set, load_patch_set
    from .worktree import export_worktree

    cfg = load_config(args.root, patch_set=args.patch_set)
    if args.action == "export":
        tree = Path(args.tree) if args.tree else cfg.root / "work" / cfg.patch_set
        export_worktree(tree, cfg.patch_set_dir)
    problems = lint_patch_set(load_patch_set(cfg.patch_set_dir))
    if not problems and args.action == "check":
        print(f"lint: {cfg.patch_set}: series and headers OK", file=sys.stderr)
        problems = freshness_problems(
            cfg.patch_set_dir,
            cache_dir(),
            cfg.work_root,
            _sdist_arg(args.sdist),
            note=lambda m: print("      " + m, file=sys.stderr),
        )
        if not problems:
            print(f"freshness: {cfg.patch_set}: every patch re-exports byte-identically", file=sys.stderr)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_tree(args) -> int:
    from .worktree import prepare_worktree

    cfg = load_config(args.root, patch_set=args.patch_set)
    dest = Path(args.dest) if args.dest else cfg.root / "work" / cfg.patch_set
    prepare_worktree(
        cfg.patch_set_dir, cfg.overlay_dir, dest, cache_dir(), _sdist_arg(args.sdist), args.force
    )
    print(dest)
    return 0


def cmd_rebase(args) -> int:
    from .rebase import rebase_report, write_report

    cfg = load_config(args.root, patch_set=args.patch_set)
    report = rebase_report(
        cfg.patch_set_dir,
        cfg.overlay_dir,
        args.version,
        cache_dir(),
        cfg.work_root,
        target_sdist=_sdist_arg(args.sdist),
        pinned_sdist=_sdist_arg(args.pinned_sdist),
        keep_tree=Path(args.tree).resolve() if args.tree else None,
    )
    md, js = write_report(report, Path(args.out or cfg.root / "rebase-report"))
    print(report.markdown())
    print(f"written: {md} and {js}")
    if args.tree:
        left_out = [p.patch for p in report.patches if p.status == "conflict"]
        print(
            f"work tree for {report.to_version}: {args.tree} (tag 'pristine' = {report.name} "
            f"{report.to_version}, one commit per applied patch"
            + (")" if report.overlay == "ok" else "; overlay not linked: see the report)")
            + "".join(
                f"\n  left out, apply there and resolve: git am -3 {cfg.patch_set_dir / name}"
                for name in left_out
            )
        )
    if report.conflicts:
        print(
            f"error: {report.conflicts} patch(es) conflict with {report.name} {report.to_version}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_upstream_tests(args) -> int:
    from .patchset import load_patch_set
    from .upstream_tests import upstream_test_tree

    cfg = load_config(args.root, patch_set=args.patch_set)
    pin = load_patch_set(cfg.patch_set_dir).pin
    dest_root = Path(args.dest or cfg.work_root / "upstream").resolve()
    tree = upstream_test_tree(
        pin, cache_dir(), dest_root, _sdist_arg(args.sdist), note=lambda m: print(m, file=sys.stderr)
    )
    print(tree)
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_build
    from .pipeline import BuildInputs

    inputs = BuildInputs.from_config(
        load_config(args.root, patch_set=args.patch_set), sdist=_sdist_arg(args.sdist)
    )
    bench_build(inputs, rounds=args.rounds)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascend_builder", description=__doc__)
    p.add_argument("--patch-set", help="directory name under patches/ (default: pyproject.toml)")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)  # tests
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build dist/vllm-<version>+ascend.<n>-py3-none-any.whl")
    b.add_argument("--sdist", help="use this local sdist instead of fetching (env VLLM_ASCEND_SDIST)")
    b.add_argument("--dist-dir", help="output directory (default: dist/)")
    b.add_argument(
        "--keep-work",
        action="store_true",
        help="keep the work directory .work/build-* (patched tree, wheel-build.log) "
        "after the build, failed or not, and print its path",
    )
    b.set_defaults(func=cmd_build)

    pa = sub.add_parser("patches", help="lint + freshness check, or export the work tree")
    pa.add_argument("action", choices=["check", "lint", "export"])
    pa.add_argument("--tree", help="work tree to export (default: work/<patch-set>)")
    pa.add_argument("--sdist", help="local sdist for the freshness check")
    pa.set_defaults(func=cmd_patches)

    t = sub.add_parser("tree", help="prepare the maintainer work tree")
    t.add_argument("--dest", help="where (default: work/<patch-set>)")
    t.add_argument("--sdist", help="local sdist (env VLLM_ASCEND_SDIST)")
    t.add_argument("--force", action="store_true", help="recreate an existing work tree")
    t.set_defaults(func=cmd_tree)

    r = sub.add_parser("rebase", help="try the series on another upstream version")
    r.add_argument("version")
    r.add_argument("--out", help="report directory (default: rebase-report/)")
    r.add_argument("--sdist", help="local sdist of the target version instead of fetching it")
    r.add_argument("--pinned-sdist", help="local sdist of the pinned version (env VLLM_ASCEND_SDIST)")
    r.add_argument(
        "--tree",
        help="keep the trial tree here as the new version's work tree (then `patches -- export`)",
    )
    r.set_defaults(func=cmd_rebase)

    u = sub.add_parser(
        "upstream-tests", help="unpack upstream's tests/ from the pinned sdist; print the path"
    )
    u.add_argument("--dest", help="where (default: .work/upstream/)")
    u.add_argument("--sdist", help="local sdist (env VLLM_ASCEND_SDIST)")
    u.set_defaults(func=cmd_upstream_tests)

    be = sub.add_parser("bench", help="benchmarks")
    be.add_argument("what", choices=["build"])
    be.add_argument("--rounds", type=int, default=3)
    be.add_argument("--sdist", help="local sdist (env VLLM_ASCEND_SDIST)")
    be.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
