"""The rollout process: a `RolloutEngine` of its own, fed weights by the trainer's publisher and
asked for generations by trainer rank 0 (`rl.remote.RemoteRollout` starts it).

    python -m megatron_fp4.rl.rollouts.worker_main '<JSON spec>'     # MEGATRON_FP4_SYNC_TOKEN in the env

(`worker_main` is the entry: this module is imported by the package (`client`), and a module run
with ``-m`` must not be, or Python warns that it was found in sys.modules before execution.)

Nothing here unpickles anything: the spec is JSON (the config as a dict), the two channels to the
trainer are token-authenticated `PeerGroup`s (`rollout.weight_sync.peer_group`: the trainer's rank 0
serves each store on the address it advertises, both sides prove they hold the token before any
process group exists), weights arrive through `rollout.weight_sync.distributed`'s JSON-header protocol
under HF Qwen3-MoE names, and requests/results are JSON plus tensors (`parallel.wire`, `rl.rollouts.wire`).

- *weights* channel: a `DistributedReceiver` serves updates on a background thread, so the
  engine keeps generating while a version is staged; the swap takes the engine's write lock.
- *control* channel, on the main thread: requests ``{"op": "generate", "prompts", "params",
  "return_routing", "min_version"}``, ``{"op": "version"}``, ``{"op": "digests"}`` (SHA-256 of each weight under its HF name,
  to check what was loaded) and ``null`` (stop). Every request gets a JSON status first
  (``{"error": null}`` or a message) and then, for a generation, the generation.
"""
from __future__ import annotations

import hashlib
import json

import torch

from megatron_fp4.config import config_from_dict
from megatron_fp4.integrations.hf.families import ours_from_hf_state_dict, to_hf_state_dict
from megatron_fp4.model import build_model
from megatron_fp4.parallel.wire import ProtocolError, broadcast_json
from megatron_fp4.rl.rollouts.wire import broadcast_generation, params_from_json
from megatron_fp4.rollout.weight_sync.buckets import manifest_of
from megatron_fp4.rollout.engine import RolloutEngine
from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup
from megatron_fp4.rollout.weight_sync.publisher import WeightReceiver
from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver

SPEC_KEYS = {"config", "pad_id", "addr", "weights_port", "control_port", "name", "timeout_s", "threads"}


class HFWeightReceiver(WeightReceiver):
    """A `WeightReceiver` for weights published under HF Qwen3-MoE names (what every publisher sends:
    a sharded trainer's `ShardedWeightPublisher`, `InProcessRollout`'s; what vLLM/SGLang load):
    mapped to the engine's own names, checked in full before anything is staged."""

    def _ours(self, named: dict) -> dict:
        try:
            return ours_from_hf_state_dict(self.engine.model, named)
        except ValueError as err:
            raise ValueError(f"rollout {self.engine.name!r} rejects the weights: {err}") from None

    def validate(self, manifest: dict) -> None:
        meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in manifest.items()}
        self.engine.check_weights({n: (tuple(t.shape), t.dtype) for n, t in self._ours(meta).items()})

    def load(self, version: int, manifest: dict, buckets) -> None:
        self.validate(manifest)
        staged = self.stage(buckets)
        if manifest_of(staged.items()) != manifest:
            raise ValueError("the buckets do not match their manifest (a transport bug); nothing was loaded")
        self.engine.load_weights(self._ours(staged), version)


def weight_digests(model) -> dict:
    """SHA-256 of every weight's bytes under its HF name (what a trainer can compare bitwise)."""
    out = {}
    for name, t in to_hf_state_dict(model).items():
        t = t.detach().contiguous()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    return out


def build_engine(cfg, pad_id: int, name: str) -> RolloutEngine:
    """The config's model in the trainer's dtype (the publisher sends the trainer's tensors as they
    are), decoding in `fp4.rollout_mode`; its initial values are replaced by the first publish."""
    model = build_model(cfg)
    if cfg.dtype == "bf16":
        model.to(torch.bfloat16)
    elif cfg.dtype == "fp64":
        model.to(torch.float64)
    model.set_fp4_mode(cfg.fp4.train_mode)
    return RolloutEngine(model, mode=cfg.fp4.rollout_mode, pad_id=pad_id, name=name,
                         invariance=cfg.numerics.invariance, inflight_updates=cfg.rl.inflight_updates)


def parse_spec(text: str) -> dict:
    spec = json.loads(text)
    if not isinstance(spec, dict) or set(spec) != SPEC_KEYS:
        raise ValueError(f"the rollout worker's spec must be a JSON object with keys {sorted(SPEC_KEYS)}")
    return spec


def handle(engine: RolloutEngine, request) -> tuple[dict, object]:
    """(status, generation or None) of one control request."""
    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
        raise ProtocolError("a request must be a JSON object with an 'op'")
    if request["op"] == "version":
        return {"error": None, "version": engine.version}, None
    if request["op"] == "digests":  # an engine that is not a RolloutEngine (vLLM's) reads its own weights
        digests = engine.weight_digests() if hasattr(engine, "weight_digests") else weight_digests(engine.model)
        return {"error": None, "version": engine.version, "digests": digests}, None
    if request["op"] != "generate":
        raise ProtocolError(f"unknown op {request['op']!r} (generate, version, digests)")
    prompts, params = request.get("prompts"), request.get("params")
    if not isinstance(prompts, list) or not isinstance(params, list) or len(params) != len(prompts):
        raise ProtocolError("generate needs 'prompts' (lists of token ids) and one 'params' entry per prompt")
    min_version = request.get("min_version", 0)
    if engine.version < min_version:
        raise RuntimeError(f"asked to generate with version >= {min_version}, but the engine serves version "
                           f"{engine.version} (the trainer must wait for the load before the next rollout)")
    gen = engine.generate([[int(t) for t in p] for p in prompts], [params_from_json(p) for p in params],
                          return_routing=bool(request.get("return_routing", False)))
    return {"error": None, "version": gen.version}, gen


def serve(spec: dict, token: str, engine=None, receiver=None) -> None:
    """The control loop (module doc). `engine`/`receiver`: another engine and its weight receiver
    (the vLLM rollout server's); default a `RolloutEngine` of the spec's config."""
    torch.set_num_threads(int(spec["threads"]))
    if engine is None:
        engine = build_engine(config_from_dict(spec["config"]), int(spec["pad_id"]), spec["name"])
    cpu = torch.device("cpu")
    # Started by the trainer's rank 0 on its host: connections bind the address it advertises.
    weights = PeerGroup(spec["addr"], spec["weights_port"], 1, 2, cpu, spec["timeout_s"], token=token,
                        bind_addr=spec["addr"])
    control = PeerGroup(spec["addr"], spec["control_port"], 1, 2, cpu, spec["timeout_s"], token=token,
                        bind_addr=spec["addr"])
    receiver = DistributedReceiver(receiver or HFWeightReceiver(engine), weights, src=0).start()
    while True:
        request = broadcast_json(None, 0, control, cpu)
        if request is None:
            break
        try:
            if receiver.failure is not None:  # the trainer hears it at its next request
                raise RuntimeError(f"the rollout's weights channel broke, it takes no more updates: {receiver.failure}")
            status, gen = handle(engine, request)
        except Exception as err:  # noqa: BLE001 - reported to the trainer, which raises it
            status, gen = {"error": f"{type(err).__name__}: {err}"}, None
        broadcast_json(status, 1, control, cpu)
        if gen is not None:
            broadcast_generation(gen, 1, control)
    receiver.join(timeout=spec["timeout_s"])  # the publisher's close() stops it
    weights.close()
    control.close()
