"""Many short `vllm` CLI runs (start-up refusals) without paying vLLM's import for each.

Such a run costs the imports of torch, vLLM and its API server (~6 s alone, several
times that on a busy 2-core machine), not its work (~0.6 s). The runs that share one
environment are forked, one after another, from an interpreter that made that import once
(``python -m tests.support.forked_cli SPEC``); each child calls the CLI's own entry point
with its argv, its stdout and stderr in files, and ends as the command would (exit status,
last line, traceback or none). Runs whose environments differ get their own interpreter,
so nothing read from the environment at import time is shared between them; a run whose
environment nobody else has, or that is neither the `vllm` CLI nor ``python -c``, is
started as it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.processes import run_job

Job = tuple[list[str], dict]


def run_forked(
    jobs: dict[Hashable, Job], workers: int, timeout: float
) -> dict[Hashable, subprocess.CompletedProcess]:
    """What ``run_concurrently`` returns for ``jobs`` (argv, environment); ``timeout`` is per
    run. At most ``workers`` interpreters at once."""
    groups: dict[tuple, list[Hashable]] = {}
    for key, (argv, env) in jobs.items():
        shareable = Path(argv[0]).name == "vllm" or argv[0] == sys.executable and argv[1] == "-c"
        group = (tuple(sorted(env.items())),) if shareable else ("alone", key)
        groups.setdefault(group, []).append(key)

    def run(keys: list[Hashable]) -> dict[Hashable, subprocess.CompletedProcess]:
        if len(keys) == 1:
            return {keys[0]: run_job(jobs[keys[0]], timeout)}
        return _run_group({key: jobs[key] for key in keys}, timeout)

    results: dict[Hashable, subprocess.CompletedProcess] = {}
    with ThreadPoolExecutor(workers) as pool:
        for done in pool.map(run, groups.values()):
            results.update(done)
    return {key: results[key] for key in jobs}


def _run_group(jobs: dict[Hashable, Job], timeout: float) -> dict[Hashable, subprocess.CompletedProcess]:
    env = next(iter(jobs.values()))[1]
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
        runs = [
            {"argv": argv, "stdout": f"{tmp}/{i}.out", "stderr": f"{tmp}/{i}.err", "timeout": int(timeout)}
            for i, (argv, _) in enumerate(jobs.values())
        ]
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(runs))
        parent = subprocess.run(
            [sys.executable, "-m", "tests.support.forked_cli", str(spec)],
            env=env,
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=60 + timeout * len(runs),
        )
        if parent.returncode != 0:
            raise RuntimeError(
                f"the forking interpreter failed ({parent.returncode}):\n{parent.stderr[-3000:]}"
            )
        codes = json.loads(parent.stdout.strip().splitlines()[-1])
        return {
            key: subprocess.CompletedProcess(
                run["argv"], code, Path(run["stdout"]).read_text(), Path(run["stderr"]).read_text()
            )
            for key, run, code in zip(jobs, runs, codes)
        }


def _child(run: dict, main) -> None:
    """In the forked child: the CLI with ``run``'s argv (or ``python -c``'s code), ended as
    the process would end."""
    import atexit
    import traceback

    signal.alarm(run["timeout"])  # SIGALRM's default action ends a run that hangs
    for fd, path in ((1, run["stdout"]), (2, run["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    argv = run["argv"]
    source = argv[2] if argv[1] == "-c" else None  # `python -c SOURCE ARGS...`
    sys.argv = list(argv) if source is None else ["-c", *argv[3:]]
    code = 0
    try:
        if source is None:
            main()
        else:
            exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:  # sys.exit("message") prints the message and exits 1
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(spec: Path) -> None:
    # what every `vllm serve` imports before it refuses (the API server, the engine
    # arguments, transformers' configs), so that no child pays for it
    import transformers  # noqa: F401

    import vllm.engine.arg_utils  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401
    from vllm.entrypoints.cli.main import main

    codes = []
    for run in json.loads(spec.read_text()):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(run, main)
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(codes))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
