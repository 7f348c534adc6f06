"""Print what the installed vLLM Ascend wheel was built from.

python examples/show_provenance.py
"""

import vllm

import vllm.ascend

prov = vllm.ascend.provenance()
if not prov:
    print(f"vllm {vllm.__version__}: no provenance (a development work tree, not a built wheel)")
else:
    up = prov["upstream"]
    print(f"vllm {prov['version']} = {up['name']} {up['version']} (sdist sha256 {up['sdist_sha256']})")
    for patch in prov["patches"]:
        print(f"  {patch['name']}  [{patch['upstream_status']}]")
    print(f"  overlay sha256 {prov['overlay']['sha256']}, builder {prov['builder']['revision']}")
