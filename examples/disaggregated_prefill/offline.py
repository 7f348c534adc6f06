"""Offline disaggregated prefill: a prefill ``LLM`` and a decode ``LLM`` in two processes,
each prompt's KV cache pulled by the decode side over the AscendP2PConnector.

    python examples/disaggregated_prefill/offline.py [--model DIR] [--max-tokens N]

The prefill process computes each prompt (one token, ``do_remote_decode``) and hands the
``kv_transfer_params`` its outputs carry to the decode process, which generates with them:
the decode side pulls the prompt's KV instead of computing it. The decode process then
resets its prefix cache and generates the same prompts on its own (colocated), and the
script prints both and exits with status 1 if any greedy output differs or nothing was
pulled. ``--prompt-lengths 31,39`` replaces the text prompts with prompts of random token
ids of those lengths (seeded), e.g. to put a sliding window's edge on a block boundary.

``--layerwise``: both processes get every prompt at once, with a transfer id
(``layerwise_id``) each; the decode side reads each layer of a prompt's KV as the prefill
forward writes it (docs/pd_disaggregation.md). Then a failed pull is an error too.

On an NPU host each process sees its own NPUs (``--prefill-devices``, ``--decode-devices``:
``ASCEND_RT_VISIBLE_DEVICES``; NPU-unverified). In host emulation (``VLLM_ASCEND_EMULATE=1``)
both run on the CPU; with no ``--model`` a tiny random Qwen2 is made first
(examples/make_tiny_model.py). The transport is Mooncake (install the wheel's
``mooncake-host`` extra here, ``mooncake`` on an NPU host). Both processes share the
P/D secret ``VLLM_ASCEND_KV_SECRET`` (a fresh one per run when it is not set). ``--json FILE`` writes the
prompts, the token ids of both runs and the pulled byte count. ``--block-size``,
``--max-num-seqs``, ``--enforce-eager`` and ``--disable-hybrid-kv-cache-manager`` are passed
to both engines as vLLM takes them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import secrets
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "Paged attention keeps keys and values in blocks",
    "The decode instance pulls the prompt's cache from the prefill instance and",
    "Disaggregated prefill separates the two phases of serving a request, so",
    "A short prompt",
]
SECRET_ENV = "VLLM_ASCEND_KV_SECRET"  # the deployment's P/D secret (vllm/ascend/kv_transfer/trust.py)
# how long the prefill side waits for the decode side to finish (seconds)
HANDOFF_TIMEOUT = 600


def _engine(args, role: str, kv_port: int):
    from vllm import LLM

    options = {"block_size": args.block_size} if args.block_size else {}
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.disable_hybrid_kv_cache_manager:
        options["disable_hybrid_kv_cache_manager"] = True
    if args.enforce_eager:
        options["enforce_eager"] = True
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=1024,
        seed=0,
        **options,
        disable_log_stats=False,  # the connector's pulled-bytes counter is a logged stat
        kv_transfer_config={
            "kv_connector": "AscendP2PConnector",
            "kv_role": role,
            "kv_port": kv_port,
            "kv_connector_extra_config": {"host": args.host},
        },
    )


def _close(llm) -> None:
    """Stop the engine-core process before this process ends: a multiprocessing child
    ends without the exit hooks that would stop it, and would wait for it forever."""
    llm.llm_engine.engine_core.shutdown()


def _greedy(max_tokens: int, kv_transfer_params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _transfer_ids(args) -> list[str]:
    return [f"offline-{i}" for i in range(len(_prompts(args)))]


def prefill(args, devices: str, handoff, done) -> None:
    os.environ["ASCEND_RT_VISIBLE_DEVICES"] = devices
    llm = _engine(args, "kv_producer", args.prefill_kv_port)
    try:
        if args.layerwise:
            ready = handoff.get(timeout=HANDOFF_TIMEOUT)  # both engines up: the prompts go at once
            if "error" in ready:
                return
            sampling = [
                _greedy(1, {"do_remote_decode": True, "layerwise_id": transfer_id})
                for transfer_id in _transfer_ids(args)
            ]
            llm.generate(_prompts(args), sampling, use_tqdm=False)
            done.wait(HANDOFF_TIMEOUT)  # the decode side reads while the engine answers
            return
        outputs = llm.generate(_prompts(args), _greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        params = [out.kv_transfer_params for out in outputs]
        if not all(params):
            handoff.put({"error": "the prefill outputs carry no kv_transfer_params (is the connector on?)"})
            return
        handoff.put({"params": params})
        # the blocks stay held for the decode side until it reports each request done; the
        # engine must be alive to answer it
        done.wait(HANDOFF_TIMEOUT)
    finally:
        _close(llm)


def decode(args, devices: str, handoff, results) -> None:
    os.environ["ASCEND_RT_VISIBLE_DEVICES"] = devices
    llm = _engine(args, "kv_consumer", args.decode_kv_port)
    prompts = _prompts(args)
    try:
        if args.layerwise:  # no hand-off: where the KV is comes from the prefill rank
            from vllm.ascend.kv_transfer.trust import LAYERWISE_FIELDS, Trust, load_secret

            handoff.put({"ready": True})
            where = {"remote_host": args.host, "remote_port": args.prefill_kv_port}
            # parameters this process makes itself: signed with the deployment's secret, as
            # the proxy signs its layer-wise ones (the decode side takes no unsigned ones)
            trust = Trust(load_secret(None, insecure=False))
            params = [
                trust.sign_params(
                    {"do_remote_prefill": True, "layerwise_id": transfer_id, **where},
                    LAYERWISE_FIELDS,
                    HANDOFF_TIMEOUT,
                )
                for transfer_id in _transfer_ids(args)
            ]
        else:
            message = handoff.get(timeout=HANDOFF_TIMEOUT)
            if "error" in message:
                results.put(message)
                return
            params = message["params"]
        # one batch, each request with the transfer parameters of its own prompt
        sampling = [_greedy(args.max_tokens, p) for p in params]
        disaggregated = llm.generate(prompts, sampling, use_tqdm=False)
        pulled, failed = (
            sum(
                metric.value
                for metric in llm.get_metrics()
                # (the registry names a counter without its _total suffix)
                if metric.name in (name, name + "_total")
            )
            for name in ("vllm:ascend_p2p_pulled_bytes", "vllm:ascend_p2p_failed_pulls")
        )
        llm.reset_prefix_cache()  # the colocated run computes every prompt itself
        colocated = llm.generate(prompts, _greedy(args.max_tokens), use_tqdm=False)
    finally:
        _close(llm)
    results.put(
        {
            "disaggregated": [list(out.outputs[0].token_ids) for out in disaggregated],
            "colocated": [list(out.outputs[0].token_ids) for out in colocated],
            "text": [out.outputs[0].text for out in disaggregated],
            "colocated_text": [out.outputs[0].text for out in colocated],
            "pulled_bytes": pulled,
            "failed_pulls": failed,
        }
    )


def _prompts(args) -> list:
    """The text prompts, or (``--prompt-lengths``) prompts of seeded random token ids."""
    if not args.prompt_lengths:
        return PROMPTS
    import random

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    rng = random.Random(0)
    # ids from 10 up: clear of the special tokens a tokenizer puts first
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]} for n in args.prompt_lengths]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random Qwen2, made here)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--dtype", default="auto", help="as vllm's --dtype (the NPU kernels need bfloat16 or float16)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both connectors bind and advertise")
    parser.add_argument("--prefill-kv-port", type=int, default=21100)
    parser.add_argument("--decode-kv-port", type=int, default=22100)
    parser.add_argument(
        "--prefill-devices", default="0", help="ASCEND_RT_VISIBLE_DEVICES of the prefill process"
    )
    parser.add_argument(
        "--decode-devices", default="1", help="ASCEND_RT_VISIBLE_DEVICES of the decode process"
    )
    parser.add_argument(
        "--prompt-lengths",
        type=lambda text: [int(n) for n in text.split(",")],
        help="comma-separated prompt lengths: prompts of random token ids instead of the text ones",
    )
    parser.add_argument("--block-size", type=int, help="vLLM's --block-size for both engines")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's --max-num-seqs for both engines")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no decode graphs (vLLM's option), on both engines"
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="one KV-cache group for every layer (vLLM's option), on both engines",
    )
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="both processes get the prompts at once; decode reads each layer as it is written",
    )
    parser.add_argument("--json", type=Path, help="write the token ids and the pulled byte count here")
    args = parser.parse_args()
    if args.model is None:
        args.model = "/tmp/pd-offline-example-model"
        if not Path(args.model).is_dir():
            print(f"making a tiny random Qwen2 in {args.model} ...", flush=True)
            maker = Path(__file__).resolve().parents[1] / "make_tiny_model.py"
            subprocess.run([sys.executable, str(maker), "--arch", "qwen2", "--out", args.model], check=True)

    if not os.environ.get(SECRET_ENV):
        # the two processes are the whole deployment: a fresh secret for this run
        os.environ[SECRET_ENV] = secrets.token_hex(32)
    # spawn: each process imports vLLM (and on an NPU host, the runtime) with its own devices
    context = multiprocessing.get_context("spawn")
    handoff, results, done = context.Queue(), context.Queue(), context.Event()
    producer = context.Process(
        target=prefill, args=(args, args.prefill_devices, handoff, done), name="prefill"
    )
    consumer = context.Process(
        target=decode, args=(args, args.decode_devices, handoff, results), name="decode"
    )
    producer.start()
    consumer.start()
    try:
        result = _wait_for(results, consumer, producer)
    finally:
        done.set()
        for process in (consumer, producer):
            process.join(120)
            if process.is_alive():
                process.terminate()
    if "error" in result:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    prompts = _prompts(args)
    for prompt, pd_text, local_text in zip(prompts, result["text"], result["colocated_text"]):
        if not isinstance(prompt, str):
            prompt = f"<{len(prompt['prompt_token_ids'])} random token ids>"
        print(f"{prompt!r}\n  disaggregated: {pd_text!r}\n  colocated:     {local_text!r}")
    print(f"KV pulled by the decode process: {result['pulled_bytes']:.0f} bytes")
    if args.json:
        args.json.write_text(json.dumps({"prompts": prompts, **result}))
    if result["disaggregated"] != result["colocated"]:
        print("error: the disaggregated and colocated outputs differ", file=sys.stderr)
        return 1
    if not result["pulled_bytes"]:
        print("error: the decode process pulled no KV (it computed the prompts itself)", file=sys.stderr)
        return 1
    if args.layerwise and result["failed_pulls"]:
        print(f"error: {result['failed_pulls']:.0f} layer-wise pulls failed", file=sys.stderr)
        return 1
    print("equal greedy outputs")
    return 0


def _wait_for(results, consumer, producer) -> dict:
    """The decode process's result; an error if either process dies first."""
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            for process in (consumer, producer):
                if not process.is_alive():
                    return {
                        "error": f"the {process.name} process exited (code {process.exitcode}) "
                        "before the decode process had a result; its output is above"
                    }


if __name__ == "__main__":
    sys.exit(main())
