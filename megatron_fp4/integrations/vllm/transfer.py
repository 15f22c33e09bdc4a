"""The `megatron_fp4` backend of vLLM's weight-transfer API: live weight updates into a separate
`vllm serve` process over the project's token-authenticated CPU sync.

    MEGATRON_FP4_SYNC_TOKEN=... VLLM_SERVER_DEV_MODE=1 vllm serve DIR \\
        --weight-transfer-config '{"backend": "megatron_fp4"}'          # DIR: an export with the plugin's block
    # trainer: integrations.vllm.serve.VLLMServerTransport(url) as a WeightPublisher transport

`plugin.register` (the `vllm.general_plugins` entry point, run in every vLLM process) registers the
backend with `WeightTransferEngineFactory`; vLLM's worker builds it when `--weight-transfer-config`
names it, and the server's RL routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`; mounted by vLLM only with `VLLM_SERVER_DEV_MODE=1`)
reach it through `collective_rpc`. This module runs in vLLM's worker process and imports vLLM.

- init `{"addr", "port", "name", "timeout_s", "bind_addr"}`: joins the trainer's `PeerGroup`
  (rank 1 of 2, gloo) with the token of this process's environment (`MEGATRON_FP4_SYNC_TOKEN`): the
  token never travels over the HTTP API, and a peer without it is refused before anything is read.
- start: drops anything staged.
- update `{"version": n}`: one `weight_sync.distributed` exchange (JSON header + raw byte buckets, nothing
  unpickled): the manifest's names, shapes and dtypes are checked against the served checkpoint's
  safetensors headers before any receive buffer is allocated (so sizes are bounded by the served
  model), then the buckets arrive into fresh buffers and every tensor is checked finite. The tensors
  are only staged; any failure is this rollout's verdict to the trainer, raised here too, and the
  served weights are untouched.
- finish: loads what the session staged (`live.load_into`: vLLM's `load_weights`, every plugin
  layer drops its Q(W)), in one step between two engine steps.

GPU: vLLM's own `nccl` backend (`NCCLWeightTransferEngine`, HF names, `load_weights` per chunk)
serves the same trainer-side calls with a `VLLMWeightSyncClient`; it loads while receiving, so it
keeps none of the checks above. Not run here (no GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from megatron_fp4.config.validate import MAX_TIMEOUT_S
from megatron_fp4.integrations.vllm.live import check_manifest, check_update, checkpoint_shapes, load_into, plugin_layers
from megatron_fp4.rollout.weight_sync.buckets import unpack_buckets
from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, sync_token_from_env
from megatron_fp4.rollout.weight_sync.peer_store import TOKEN_ENV
from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver

BACKEND = "megatron_fp4"


@dataclass
class FP4InitInfo(WeightTransferInitInfo):
    """Where the trainer's `PeerGroup` listens (its rank 0) and this rollout's name in verdicts."""

    addr: str
    port: int
    name: str = "vllm-serve"
    timeout_s: float = 600.0
    bind_addr: Optional[str] = None  # the address this side's gloo connections bind (default 127.0.0.1 / Ray's)

    def __post_init__(self):
        if not isinstance(self.addr, str) or not self.addr or not isinstance(self.name, str):
            raise ValueError(f"init_info: addr must be a host name or address, name a string (got {self.addr!r}, "
                             f"{self.name!r})")
        if type(self.port) is not int or not 0 < self.port < 65536:
            raise ValueError(f"init_info: port={self.port!r} must be an integer in 1..65535")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s <= MAX_TIMEOUT_S):  # bounded: it becomes a timedelta
            raise ValueError(f"init_info: timeout_s={self.timeout_s!r} must be a number of seconds in (0, "
                             f"{MAX_TIMEOUT_S}] (a week)")
        if self.bind_addr is not None and not isinstance(self.bind_addr, str):
            raise ValueError(f"init_info: bind_addr={self.bind_addr!r} must be an address or null")


@dataclass
class FP4UpdateInfo(WeightTransferUpdateInfo):
    """The version the trainer publishes in this exchange (its header must carry the same)."""

    version: int

    def __post_init__(self):
        if type(self.version) is not int:
            raise ValueError(f"update_info: version={self.version!r} must be an integer")


class _Staging:
    """The `WeightReceiver` side `DistributedReceiver` drives: checks, stages, loads nothing."""

    def __init__(self, name: str, served: dict, version: int):
        self.name, self.served, self.version = name, served, version
        self.tensors: Optional[dict] = None

    def validate(self, manifest: dict) -> None:
        check_manifest(self.served, manifest)

    def load(self, version: int, manifest: dict, buckets) -> None:
        if version != self.version:
            raise ValueError(f"the trainer's header carries version {version}, update_info version {self.version}")
        tensors = unpack_buckets(buckets)
        check_update(self.served, tensors)  # names, shapes and dtypes again, then finite
        self.tensors = tensors


class MegatronFP4WeightTransferEngine(WeightTransferEngine[FP4InitInfo, FP4UpdateInfo]):
    """vLLM's worker-side weight-transfer engine over a `PeerGroup` (module doc)."""

    init_info_cls = FP4InitInfo
    update_info_cls = FP4UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Optional[PeerGroup] = None
        self.name, self.served, self.staged = "vllm-serve", {}, {}

    def init_transfer_engine(self, init_info: FP4InitInfo) -> None:
        if not plugin_layers(self.model):
            raise ValueError("weight transfer 'megatron_fp4': the model is not served with the megatron_fp4 plugin "
                             "(config.json has no quantization_config block); stock vLLM's CPU layers keep "
                             "prepacked copies of their weights that a load would leave stale")
        token = sync_token_from_env()
        if token is None:
            raise ValueError(f"weight transfer 'megatron_fp4': {TOKEN_ENV} is not set in the environment of vllm "
                             "serve; start the server with the trainer's token in it")
        group = PeerGroup(init_info.addr, init_info.port, 1, 2, torch.device("cpu"), init_info.timeout_s,
                          token=token, bind_addr=init_info.bind_addr)  # a refused join keeps the current trainer
        self.shutdown()
        self.served = checkpoint_shapes(self.model_config.model)
        self.name, self.group = init_info.name, group

    def start_weight_update(self) -> None:
        self.staged = {}

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def receive_weights(self, update_info: FP4UpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight transfer 'megatron_fp4' is not initialised: POST /init_weight_transfer_engine")
        staging = _Staging(self.name, self.served, update_info.version)
        receiver = DistributedReceiver(staging, self.group, src=0)
        if not receiver.serve_one():
            raise RuntimeError("the trainer closed the weight transfer instead of sending a version")
        if staging.tensors is None:
            self.staged = {}
            version, error = receiver.errors[-1] if receiver.errors else (update_info.version, "refused")
            raise ValueError(f"weight update to version {version} refused: {error}; the served weights are unchanged")
        self.staged.update(staging.tensors)

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, {}
        if staged:
            load_into(self.model, staged)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

