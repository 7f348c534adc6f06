"""``nox -s rebase``'s drift check (build/ascend_builder/drift.py) on two synthetic releases:
each kind of upstream move the overlay depends on is reported, and nothing else is."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ascend_builder.drift import compare
from ascend_builder.gitutil import git

OLD = {
    "requirements/common.txt": "transformers >= 5.16.1, < 5.21.0\nnumpy\nfilelock >= 3.20\n",
    "vllm/platforms/interface.py": """
        class Platform:
            device_name: str = "cuda"

            @classmethod
            def is_cpu(cls) -> bool:
                return False

            @classmethod
            def graph_capture_context(cls, device):
                pass

            @classmethod
            def old_hook(cls):
                pass
    """,
    "vllm/config/compilation.py": """
        class CompilationConfig:
            cudagraph_capture_sizes: list[int] | None = None
            use_v1_thing: bool = False
    """,
    "vllm/config/cache.py": """
        class CacheConfig:
            DEFAULT_BLOCK_SIZE: ClassVar[int] = 16
            block_size: int = Field(default=None, gt=0)
            swap_space: float = 4
            cpu_offload_gb: float = 0
    """,
    "vllm/envs.py": """
        environment_variables = {
            "VLLM_USE_V2_MODEL_RUNNER": lambda: 1,
            "VLLM_HOST_IP": lambda: "",
        }
    """,
    "vllm/v1/worker/block_table.py": "class ComputeSlotMappingKernel:\n    kernel = None\n",
    "vllm/v1/worker/gpu/model_runner.py": "class GPUModelRunner:\n    pass\n\ndef helper():\n    pass\n",
}
NEW = {
    "requirements/common.txt": "transformers >= 5.16.1, < 5.23.0\nnumpy\n",
    "vllm/platforms/interface.py": """
        class Platform:
            device_name: str = "cuda"

            @classmethod
            def is_cpu(cls) -> bool:
                return False

            @classmethod
            def graph_capture_context(cls, device, stream=None):
                pass

            @classmethod
            def is_confidential_compute(cls) -> bool:
                return False
    """,
    "vllm/config/compilation.py": """
        class CompilationConfig:
            cudagraph_capture_sizes: list[int] | None = None
            decode_cudagraph_capture_request_sizes: list[int] | None = None
    """,
    "vllm/config/cache.py": """
        class CacheConfig:
            DEFAULT_BLOCK_SIZE: ClassVar[int] = 64
            block_size: int = Field(default=None, gt=0)
            swap_space: float = 8
            cpu_offload_gb: float = 1
    """,
    "vllm/envs.py": """
        environment_variables = {
            "VLLM_HOST_IP": lambda: "",
        }
        # VLLM_USE_V2_MODEL_RUNNER is gone
    """,
    "vllm/v1/worker/gpu/model_runner.py": "class GPUModelRunner:\n    pass\n",
}
OVERLAY = {
    "vllm/ascend/platform.py": """
        from vllm.platforms.interface import Platform
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner, helper
        import vllm.envs as envs

        KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


        class NPUPlatform(Platform):
            @classmethod
            def graph_capture_context(cls, device):
                return envs.VLLM_USE_V2_MODEL_RUNNER, envs.VLLM_HOST_IP

            def sizes(self, vllm_config):
                return (
                    vllm_config.compilation_config.cudagraph_capture_sizes,
                    vllm_config.compilation_config.use_v1_thing,
                    vllm_config.cache_config.swap_space,
                )
    """,
}


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text).lstrip("\n"))


def _two_releases(tmp_path: Path) -> tuple[Path, Path]:
    tree, overlay = tmp_path / "tree", tmp_path / "overlay"
    tree.mkdir()
    git("init", "-q", cwd=tree)
    _write(tree, OLD)
    git("add", "-A", cwd=tree)
    git("commit", "-q", "-m", "old", cwd=tree)
    for path in OLD.keys() - NEW.keys():
        (tree / path).unlink()
    _write(tree, NEW)
    git("add", "-A", cwd=tree)
    git("commit", "-q", "-m", "new", cwd=tree)
    _write(overlay, OVERLAY)
    return tree, overlay


def test_each_upstream_move_the_overlay_depends_on_is_reported(tmp_path):
    tree, overlay = _two_releases(tmp_path)
    drift = compare(tree, "HEAD~1", "HEAD", overlay)
    assert drift.requirements == [
        "requirements/common.txt: filelock removed (was >= 3.20)",
        "requirements/common.txt: transformers >= 5.16.1, < 5.21.0 -> >= 5.16.1, < 5.23.0",
    ]
    assert drift.missing_imports == [
        "module vllm.v1.worker.block_table (overlay: vllm/ascend/platform.py)",
        "vllm.v1.worker.gpu.model_runner.helper (overlay: vllm/ascend/platform.py)",
    ]
    assert drift.platform == [
        "new: is_confidential_compute(cls) (the overlay does not define it)",
        "gone: old_hook (the overlay does not define it)",
        "parameters changed: graph_capture_context(cls, device) -> (cls, device, stream) "
        "(the overlay defines it)",
    ]
    assert drift.config == ["CompilationConfig.use_v1_thing (overlay: vllm/ascend/platform.py)"]
    # a class constant and a default the overlay reads; not cpu_offload_gb, which it does not
    assert drift.defaults == ["CacheConfig.DEFAULT_BLOCK_SIZE: 16 -> 64", "CacheConfig.swap_space: 4 -> 8"]
    assert drift.env == ["VLLM_USE_V2_MODEL_RUNNER (overlay: vllm/ascend/platform.py)"]
    text = "\n".join(drift.markdown())
    assert "## What moved under the overlay" in text and "- module vllm.v1.worker.block_table" in text


def test_no_move_reports_nothing(tmp_path):
    tree, overlay = _two_releases(tmp_path)
    drift = compare(tree, "HEAD", "HEAD", overlay)
    assert all(not items for _, items in drift.sections())
