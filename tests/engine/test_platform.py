"""The NPU platform's start-up rules, checked with the contract double reporting one NPU
(so the real NPUPlatform is selected), and host emulation's accelerator answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.forked_cli import run_forked
from tests.support.models import MLA512
from tests.support.processes import run_concurrently
from tests.support.vllm_cli import vllm_command

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("needs the torch_npu contract double", allow_module_level=True)

NPU_HOST = {"TORCH_NPU_DOUBLE_DEVICES": "1"}  # the double answers "one NPU": NPUPlatform is chosen


def _eagle3(tiny_models) -> dict:
    """A speculative method the Ascend V2 runner does not run yet: EAGLE-3 (the config only
    names a Llama-shaped draft; no EAGLE-3 head is loaded by these checks)."""
    return {"method": "eagle3", "model": str(tiny_models["llama"]), "num_speculative_tokens": 2}


def _python(code: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_EMULATE"}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def refusals(tiny_models, tmp_path_factory) -> dict:
    """Every start-up refusal below, each a `vllm serve` that must stop before serving
    (each one CLI run whose import dominates: those of one environment share an import,
    tests/support/forked_cli.py; the tests read the results)."""
    qwen2 = str(tiny_models["qwen2"])
    jobs = {}
    for i, (args, extra_env, _) in enumerate(NPU_START_UP_ERRORS):
        args = [json.dumps(_eagle3(tiny_models)) if a == "EAGLE3" else a for a in args]
        jobs[("npu", i)] = vllm_command(
            "serve", qwen2, "--host", "127.0.0.1", "--port", "1", *args, extra_env={**NPU_HOST, **extra_env}
        )
    jobs["nnal"] = vllm_command(
        "serve",
        str(tiny_models["deepseek_v3_mla512"]),
        *("--host", "127.0.0.1", "--port", "1", "--dtype", "bfloat16"),
        extra_env={**NPU_HOST, "TORCH_NPU_DOUBLE_NNAL": "0"},
    )
    jobs["float32_npu_path"] = vllm_command(
        "serve",
        qwen2,
        "--dtype",
        "float32",
        "--port",
        "1",
        emulate="1",
        extra_env={"VLLM_ASCEND_KERNELS": "npu"},
    )
    spec = '{"method": "deepseek_mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1}'
    jobs["mtp_draft_tp"] = vllm_command(
        "serve",
        str(tiny_models["deepseek_v3"]),
        *("--dtype", "float32", "--port", "1", "--tensor-parallel-size", "2", "--speculative-config", spec),
        emulate="1",
    )
    moe = str(tiny_models["deepseek_v3"])  # LoRA runs on dense models only
    jobs["lora_cli"] = vllm_command(
        "serve", moe, "--dtype", "float32", "--port", "1", "--enable-lora", emulate="1"
    )
    jobs["lora_api"] = (
        [sys.executable, "-c", f"from vllm import LLM; LLM({moe!r}, dtype='float32', enable_lora=True)"],
        dict(os.environ, VLLM_ASCEND_EMULATE="1"),
    )
    capped = _with_config(
        tiny_models["llama"], tmp_path_factory.mktemp("capped"), attn_logit_softcapping=30.0
    )
    jobs["soft_cap_cli"] = vllm_command(  # NPU-path mode: the NPU kernels cannot cap logits
        "serve",
        str(capped),
        *("--dtype", "bfloat16", "--port", "1"),
        emulate="1",
        extra_env={"VLLM_ASCEND_KERNELS": "npu"},
    )
    for i, (args, _) in enumerate(CONTEXT_PARALLEL_REFUSALS):
        jobs[("context_parallel", i)] = vllm_command(
            "serve", qwen2, "--dtype", "float32", "--port", "1", *args, emulate="1"
        )
    return run_forked(jobs, workers=2, timeout=600)


def test_forked_runs_end_as_their_own_processes_would():
    """The refusals' harness against plain processes: exit status, output, traceback."""
    env = dict(os.environ, VLLM_ASCEND_EMULATE="1")
    jobs = {
        "exit": ([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], env),
        "raise": (
            [sys.executable, "-c", "import sys; print('err', file=sys.stderr); raise KeyError(7)"],
            env,
        ),
        "message": ([sys.executable, "-c", "import sys; sys.exit('stopped: a message')"], env),
        "cli": vllm_command("serve", "--no-such-flag", emulate="1"),
    }
    forked, plain = run_forked(jobs, workers=2, timeout=300), run_concurrently(jobs, workers=2, timeout=300)
    for key in jobs:
        a, b = forked[key], plain[key]
        assert (a.returncode, a.stdout) == (b.returncode, b.stdout), (key, a, b)
        assert a.stderr.strip().splitlines()[-1:] == b.stderr.strip().splitlines()[-1:], (
            key,
            a.stderr,
            b.stderr,
        )
        assert ("Traceback" in a.stderr) == ("Traceback" in b.stderr), key
    assert forked["exit"].returncode == 3 and forked["raise"].returncode == 1


def _with_config(model: Path, out: Path, **changes) -> Path:
    """A copy of a tiny model whose config.json has ``changes``."""
    shutil.copytree(model, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_api_server_side_never_initialises_the_npu_runtime(tiny_models):
    """Building the engine config (what the API server does) asks the platform for the
    device name and memory; on an NPU host that must not create an NPU context there."""
    result = _python(
        f"""
        import vllm, torch_npu
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        config = EngineArgs(model={str(tiny_models["qwen2"])!r}, dtype="bfloat16").create_engine_config()
        print("PLATFORM", type(current_platform).__name__, config.cache_config.block_size)
        print("RUNTIME_CALLS", torch_npu.npu.runtime_calls)
    """,
        NPU_HOST,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PLATFORM NPUPlatform 128" in result.stdout
    assert "RUNTIME_CALLS []" in result.stdout


def test_the_platform_block_size_outlives_upstream_s_backend_pass(tiny_models):
    """The platform picks the KV block size at config time; upstream's executors later ask
    each model's attention backends for a preferred size (``get_preferred_block_size``)
    starting from upstream's own default (64 since 0.34). Answered by upstream's base
    class, that moved host emulation and the NPU MLA kernel (16 or 128 only) to 64."""
    code = """
        import sys
        from vllm.config import set_current_vllm_config
        from vllm.config.cache import CacheConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.ascend.attention.backend import AscendAttentionBackend
        from vllm.ascend.attention.mla import AscendMLABackend
        for model, backend in zip(sys.argv[1:], (AscendAttentionBackend, AscendMLABackend)):
            config = EngineArgs(model=model, dtype="bfloat16").create_engine_config()
            with set_current_vllm_config(config):
                preferred = backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
            print("BLOCK", type(current_platform).__name__, config.cache_config.block_size, preferred)
    """
    models = [str(tiny_models["qwen2"]), str(tiny_models[MLA512])]
    answers = {}
    for name, env in (("npu", NPU_HOST), ("host", {"VLLM_ASCEND_EMULATE": "1"})):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *models],
            env={**{k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_EMULATE"}, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        answers[name] = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("BLOCK")]
    # (platform, chosen at config time, the backend's answer): Qwen2 (GQA), DeepSeek (MLA)
    assert answers["npu"] == [["NPUPlatform", "128", "128"]] * 2, answers
    assert answers["host"] == [["HostEmulationPlatform", "16", "16"]] * 2, answers


# (serve arguments, environment, the error line's start) on an "NPU host" (the double)
NPU_START_UP_ERRORS = [
    (("--dtype", "float32"), {}, "error: dtype float32 is not supported by the Ascend NPU kernels"),
    (
        ("--dtype", "bfloat16", "--block-size", "16"),
        {},
        "error: --block-size 16 is not supported by the Ascend NPU attention kernels",
    ),
    # what upstream would run on its V1 runner, which the distribution does not have
    (
        ("--dtype", "bfloat16", "--speculative-config", "EAGLE3"),
        {},
        "error: the Ascend model runner does not run speculative method 'eagle3' "
        "(speculative methods it runs: mtp, ngram, ngram_gpu, draft_model, eagle)",
    ),
    (
        ("--dtype", "bfloat16"),
        {"VLLM_USE_V2_MODEL_RUNNER": "0"},
        "error: VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed",
    ),
]


@pytest.mark.parametrize("case", range(len(NPU_START_UP_ERRORS)))
def test_npu_start_up_errors_are_one_line(case, refusals):
    result = refusals[("npu", case)]
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(NPU_START_UP_ERRORS[case][2]), last
    assert "Traceback" not in result.stderr


def test_missing_nnal_stops_an_mla_model_at_start_up(refusals):
    """Without NNAL (the double mirrors torch_npu's lazy ATB guard) an MLA model would die
    at its first KV-cache write; the platform names the problem in one line instead."""
    result = refusals["nnal"]
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: MLA models need torch_npu's ATB ops"), last
    assert "Please check that the nnal package is installed" in last and "set_env.sh" in last
    assert "Traceback" not in result.stderr


def test_float32_in_npu_path_mode_is_refused_too(refusals):
    result = refusals["float32_npu_path"]
    assert result.returncode == 1 and "use --dtype with one of: bfloat16, float16" in result.stderr


def test_lora_on_a_moe_model_is_refused_in_one_line_before_any_process_starts(refusals):
    """In the CLI an error line; in the Python API one exception from the constructor, no
    engine-core process started (it would log its own traceback)."""
    cli, api = refusals["lora_cli"], refusals["lora_api"]
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert (
        cli.stderr.strip().splitlines()[-1].startswith("error: LoRA on MoE and MLA models is not supported")
    ), cli.stderr[-3000:]
    assert api.returncode == 1, api.stderr[-3000:]
    last = api.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm.ascend.errors.AscendConfigError: LoRA on MoE and MLA models"), last
    assert "EngineCore" not in api.stdout + api.stderr


def test_data_parallel_ranks_get_their_own_devices():
    # imported here: importing the worker resolves vLLM's current platform in this process,
    # which the unit tests' config checks need to be host emulation
    from vllm.ascend.worker.worker import device_local_rank

    config = SimpleNamespace(
        data_parallel_size=2,
        distributed_executor_backend="mp",
        data_parallel_backend="mp",
        nnodes_within_dp=1,
        data_parallel_rank_local=1,
        data_parallel_index=1,
        pipeline_parallel_size=1,
        world_size=2,
        prefill_context_parallel_size=1,
        tensor_parallel_size=2,
        data_parallel_external_lb=False,
        local_world_size=2,
    )
    assert [device_local_rank(config, r) for r in (0, 1)] == [2, 3]
    config.data_parallel_rank_local = None  # falls back to the DP index, as upstream does
    assert device_local_rank(config, 1) == 3
    config.data_parallel_size = 1
    assert device_local_rank(config, 1) == 1
    config.data_parallel_size, config.distributed_executor_backend = 2, "ray"  # Ray assigns devices itself
    assert device_local_rank(config, 1) == 1
    # an external load balancer: one process per DP rank, replicas packed onto each node's devices
    config.distributed_executor_backend, config.data_parallel_external_lb = "mp", True
    config.data_parallel_size, config.data_parallel_index = 8, 5
    assert device_local_rank(config, 1, visible=8) == 1 + (5 % 4) * 2
    assert device_local_rank(config, 0, visible=5) == (5 % 2) * 2  # 5 NPUs: two replicas, one unused
    with pytest.raises(RuntimeError, match="needs 2 NPUs on this node .* but 1 are visible"):
        device_local_rank(config, 0, visible=1)
    config.nnodes_within_dp, config.local_world_size = 2, 1  # a replica across two nodes: one NPU here
    assert device_local_rank(config, 0, visible=4) == 5 % 4


def test_upstream_cleanup_helper_works_in_a_test_process():
    """Upstream's test fixtures call cleanup_dist_env_and_memory(), which empties the
    accelerator cache; in host emulation that must work in any process importing vllm."""
    result = _python(
        """
        import vllm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()
        import torch
        torch.accelerator.synchronize()
        # Upstream's KV connectors ask for the device index and hand it back as an int.
        from vllm.platforms import current_platform
        index = torch.accelerator.current_device_index()
        current_platform.set_device(index)
        current_platform.set_device(torch.device("cpu", 0))
        current_platform.check_runner_kv_caches_multi_layer()  # no per-index cache list
        print("CLEAN", index)
    """,
        {"VLLM_ASCEND_EMULATE": "1"},
    )
    assert result.returncode == 0 and "CLEAN 0" in result.stdout, result.stderr[-3000:]


def test_a_model_feature_the_backends_lack_is_one_line_before_any_process_starts(refusals):
    """A Llama whose config declares attention logit soft-capping, in NPU-path mode (the
    reference kernels cap, torch_npu's fused attention cannot); the configurations themselves:
    tests/unit/platform/test_model_features.py."""
    result = refusals["soft_cap_cli"]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: not supported on Ascend yet: attention logit soft-capping with the NPU attention "
        "kernels (attn_logit_softcapping=30.0"
    ), last
    assert "EngineCore" not in result.stdout + result.stderr


def test_speculative_settings_the_platform_cannot_run_are_one_line(refusals):
    result = refusals["mtp_draft_tp"]
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: speculative draft_tensor_parallel_size 1 differs from --tensor-parallel-size 2"
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "change, refused",
    [
        ({}, None),
        ({"rejection_sample_method": "block"}, "rejection_sample_method 'block'"),
        ({"rejection_sample_method": "fly"}, "rejection_sample_method 'fly'"),
        ({"parallel_drafting": True}, "parallel_drafting"),
        ({"quantization": "fp8"}, "fp8-quantized model"),
        ({"quantization": "ascend"}, None),  # msModelSlim: the MTP module follows the description
        ({"draft_tensor_parallel_size": 2}, None),
    ],
)
def test_speculative_config_checks(change, refused):
    from vllm.ascend.spec_decode.config import validate_speculative_config

    spec = SimpleNamespace(
        method="mtp",
        draft_tensor_parallel_size=None,
        rejection_sample_method="standard",
        parallel_drafting=False,
    )
    for key, value in change.items():
        if key != "quantization":
            setattr(spec, key, value)
    config = SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        model_config=SimpleNamespace(quantization=change.get("quantization")),
    )
    if refused is None:
        validate_speculative_config(config)
    else:
        with pytest.raises(ValueError, match=refused.replace("(", r"\(").replace(")", r"\)")):
            validate_speculative_config(config)


# (serve arguments of the Qwen2 model, the error line's start). Qwen2 has 2 KV heads: DCP 2
# at TP 2 (or DCP 4 at TP 4) would leave a head's tokens on fewer ranks than DCP.
CONTEXT_PARALLEL_REFUSALS = [
    (
        ("--tensor-parallel-size", "2", "--decode-context-parallel-size", "4"),
        "error: decode_context_parallel_size 4 must divide tensor_parallel_size 2",
    ),
    (
        ("--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"),  # upstream's own rule
        "error: Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater",
    ),
    (
        ("--tensor-parallel-size", "4", "--decode-context-parallel-size", "4"),
        "error: `--decode-context-parallel-size` (4) exceeds the maximum supported value (2)",
    ),
    (
        (
            "--prefill-context-parallel-size",
            "2",
            "--block-size",
            "8",
            "--cp-kv-cache-interleave-size",
            "3",
        ),
        "error: cp_kv_cache_interleave_size 3 must divide the block size 8",
    ),
]


@pytest.mark.parametrize("case", range(len(CONTEXT_PARALLEL_REFUSALS)))
def test_context_parallel_layouts_the_platform_cannot_run_are_one_line(case, refusals):
    result = refusals[("context_parallel", case)]
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(CONTEXT_PARALLEL_REFUSALS[case][1]), last
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "change, refused",
    [
        ({}, None),
        ({"speculative_config": object()}, "speculative decoding with context parallelism"),
        ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
        (
            {
                "kv_transfer_config": SimpleNamespace(
                    kv_connector="NixlConnector", kv_connector_module_path=None
                )
            },
            "KV connector NixlConnector",
        ),
        (
            {
                "kv_transfer_config": SimpleNamespace(
                    kv_connector="AscendP2PConnector", kv_connector_module_path=None
                )
            },
            None,
        ),
        ({"sliding_window": 128}, "full attention only"),
        ({"soft_cap": 50.0}, "soft-capping"),
        ({"model_type": "gpt_oss"}, "attention sinks"),
        ({"enable_expert_parallel": True}, "expert parallelism with prefill context parallelism"),
        ({"enable_expert_parallel": True, "pcp": 1}, None),  # DCP with EP: tested equal to TP=1
        ({"pcp": 1, "dcp": 1, "speculative_config": object()}, None),  # no context parallelism: no CP rule
    ],
)
def test_context_parallel_config_checks(change, refused, monkeypatch):
    from vllm.ascend.platform.checks import check_context_parallel

    monkeypatch.setenv("VLLM_ASCEND_EMULATE", "1")  # the reference kernels' rules

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=2,
            prefill_context_parallel_size=change.get("pcp", 2),
            decode_context_parallel_size=change.get("dcp", 2),
            data_parallel_size=1,
            cp_kv_cache_interleave_size=1,
            pipeline_parallel_size=change.get("pipeline_parallel_size", 1),
            enable_expert_parallel=change.get("enable_expert_parallel", False),
        ),
        cache_config=SimpleNamespace(block_size=128),
        model_config=SimpleNamespace(
            use_mla=True,
            get_total_num_kv_heads=lambda: 1,
            is_hybrid=False,
            is_moe=True,
            get_sliding_window=lambda: change.get("sliding_window"),
            hf_text_config=SimpleNamespace(attn_logit_softcapping=change.get("soft_cap")),
            hf_config=SimpleNamespace(model_type=change.get("model_type", "deepseek_v3")),
        ),
        speculative_config=change.get("speculative_config"),
        kv_transfer_config=change.get("kv_transfer_config"),
    )
    if refused is None:
        check_context_parallel(config)
    else:
        with pytest.raises(ValueError, match=refused):
            check_context_parallel(config)


def test_upstream_parallel_config_accepts_the_production_context_parallel_layouts():
    """Through upstream's ParallelConfig (patch
    ``parallel-let-the-platform-define-the-context-parallel-layout`` hands the TP/PCP/DCP
    rule to the platform): the layouts users run are accepted, where upstream's own rule would refuse
    e.g. PCP 2 with DCP 4 at TP 8; a DCP that does not divide TP is one clear error."""
    result = _python(
        """
        from vllm.config import ParallelConfig
        from vllm.ascend.errors import AscendConfigError

        for tp, pcp, dcp, dp in [(8, 2, 8, 1), (8, 1, 4, 2), (8, 2, 4, 1), (4, 1, 2, 4), (8, 2, 1, 1),
                                 (4, 1, 2, 1), (16, 1, 2, 1), (8, 1, 2, 2)]:
            config = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                                    decode_context_parallel_size=dcp, data_parallel_size=dp,
                                    distributed_executor_backend="mp")
            print("ACCEPTED", tp, pcp, dcp, config.world_size)
        try:
            ParallelConfig(tensor_parallel_size=8, prefill_context_parallel_size=2,
                           decode_context_parallel_size=3, distributed_executor_backend="mp")
        except AscendConfigError as exc:
            print("REFUSED", exc)
    """,
        {"VLLM_ASCEND_EMULATE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ACCEPTED") == 8
    assert "ACCEPTED 8 2 4 16" in result.stdout  # PCP x TP ranks per DP rank
    assert "REFUSED decode_context_parallel_size 3 must divide tensor_parallel_size 8" in result.stdout
