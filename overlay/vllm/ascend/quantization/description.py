"""``quant_model_description.json`` of an msModelSlim checkpoint: which scheme each layer has.

The file maps checkpoint tensor names to scheme strings (``"model.layers.0.mlp.down_proj.weight":
"W8A8_DYNAMIC"``), next to a few metadata fields (``model_quant_type``, ``version``,
``group_size``, ...). A layer's scheme is the entry of its ``<prefix>.weight``. vLLM fuses
some checkpoint layers into one module (``qkv_proj`` from ``q_proj``/``k_proj``/``v_proj``);
such a module takes the scheme its shards share, and shards that disagree are an error.
"""

from __future__ import annotations

import json
from pathlib import Path

FLOAT = "FLOAT"
W8A8 = "W8A8"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W4A8_DYNAMIC = "W4A8_DYNAMIC"  # MoE experts only
SUPPORTED = (FLOAT, W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC)
FILENAME = "quant_model_description.json"
# metadata fields msModelSlim writes beside the tensor entries
METADATA = frozenset(
    {
        "model_quant_type",
        "version",
        "group_size",
        "metadata",
        "optional",
        "kv_quant_type",
        "kv_cache_type",
        "fa_quant_type",
        "reduce_quant_type",
    }
)


class DescriptionError(ValueError):
    """The description does not say how to build a layer, or says something this build cannot do."""


class QuantDescription:
    def __init__(self, entries: dict, source: str = FILENAME):
        self.source = source
        self.entries: dict[str, str] = {}
        for key, value in entries.items():
            if key in METADATA or not isinstance(value, str):
                continue
            self.entries[key] = value
            # msModelSlim names the DeepSeek MTP head ``shared_head.head``; vLLM's prefix drops ``shared_head``
            if ".shared_head." in key:
                self.entries.setdefault(key.replace(".shared_head.", "."), value)
        unknown = sorted(
            {(v, k) for k, v in self.entries.items() if k.endswith(".weight") and v not in SUPPORTED}
        )
        if unknown:
            scheme, tensor = unknown[0]
            raise DescriptionError(
                f"{source}: {tensor} uses the quantization scheme {scheme!r}, which this build does not support "
                f"({len(unknown)} tensor(s) in all); supported: {', '.join(SUPPORTED)}"
            )
        self.model_quant_type = entries.get("model_quant_type")
        self.version = entries.get("version")
        self.group_size = entries.get("group_size", 0)
        if W4A8_DYNAMIC in self.entries.values() and (
            self.version != "1.0.0" or self.group_size not in (0, None)
        ):
            raise DescriptionError(
                f"{source}: W4A8_DYNAMIC weights are served in msModelSlim's per-channel format "
                f'(version "1.0.0", group_size 0, two int4 per int8); this one has version '
                f"{self.version!r}, group_size {self.group_size!r} (per-group and the older unpacked "
                "format are not supported): quantize per channel"
            )

    @classmethod
    def load(cls, path: str | Path) -> QuantDescription:
        path = Path(path)
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DescriptionError(f"cannot read the quantization description {path}: {e}") from e
        if not isinstance(entries, dict):
            raise DescriptionError(f"{path} must be a JSON object of tensor name -> scheme")
        return cls(entries, str(path))

    def tensor_scheme(self, name: str) -> str | None:
        return self.entries.get(name)

    def _weight_scheme(self, prefix: str) -> str:
        scheme = self.entries.get(f"{prefix}.weight")
        if scheme is None:
            raise DescriptionError(
                f"{self.source} has no entry for the layer {prefix} (expected a key "
                f"'{prefix}.weight'; unquantized layers are listed as \"FLOAT\")"
            )
        return scheme

    def layer_scheme(self, prefix: str, packed: dict[str, list[str]] | None = None) -> str:
        """The scheme of the vLLM module at ``prefix``; fused modules from their shards."""
        parent, _, name = prefix.rpartition(".")
        shards = (packed or {}).get(name)
        if not shards:
            return self._weight_scheme(prefix)
        schemes = {shard: self._weight_scheme(f"{parent}.{shard}" if parent else shard) for shard in shards}
        if len(set(schemes.values())) > 1:
            listed = ", ".join(f"{shard}: {scheme}" for shard, scheme in schemes.items())
            raise DescriptionError(
                f"{self.source}: vLLM fuses the layers of {prefix} into one, but their schemes "
                f"differ ({listed}); quantize them with one scheme"
            )
        return next(iter(schemes.values()))

    def experts_scheme(self, prefix: str) -> str:
        """The scheme of a MoE layer's routed experts (``<prefix>.<e>.<proj>.weight``): one for all."""
        start = prefix + "."
        schemes: dict[str, str] = {}
        for key, scheme in self.entries.items():
            if (
                key.startswith(start)
                and key.endswith(".weight")
                and key[len(start) :].split(".", 1)[0].isdigit()
            ):
                schemes.setdefault(scheme, key)
        if not schemes:
            raise DescriptionError(
                f"{self.source} has no entries for the experts of {prefix} "
                f"(expected keys like '{prefix}.0.gate_proj.weight')"
            )
        if len(schemes) > 1:
            listed = ", ".join(f"{key}: {scheme}" for scheme, key in schemes.items())
            raise DescriptionError(
                f"{self.source}: the experts of {prefix} mix schemes ({listed}); "
                "one MoE layer takes one scheme"
            )
        return next(iter(schemes))

    def quantized_tensors_matching(self, fragment: str) -> list[str]:
        """Weights whose name contains ``fragment`` and that are not float."""
        return sorted(
            k for k, v in self.entries.items() if fragment in k and k.endswith(".weight") and v != FLOAT
        )
