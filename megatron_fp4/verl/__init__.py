"""verl adapters: checkpoint engine "megatron_fp4", a rollout (BaseRollout, verl rollout registry
name "megatron_fp4") over `RolloutEngine` and its replica/server (`RolloutReplicaRegistry`
"megatron_fp4"), a training engine (BaseEngine, EngineRegistry backend "megatron_fp4", engine config
`MegatronFP4EngineConfig`), verl platform "cpu" (`VERL_PLATFORM=cpu`) and the truncated-IS loss.
See docs/verl.md.

verl looks these up by name in its registries, which this package fills when imported. A verl run
imports it with `VERL_USE_EXTERNAL_MODULES=megatron_fp4.verl` (verl imports the listed
modules at `import verl`, in every worker process that inherits the environment);
`checkpoint_engine.custom_backend_module` alone comes too late, as verl's `init_model` builds the
actor's engine and the rollout before it imports that module.

Importing this package needs verl (`pip install megatron-fp4[verl]`); nothing else in
megatron_fp4 imports it.
"""
try:
    import verl  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without verl
    raise ImportError("megatron_fp4.verl needs verl; install it with "
                      "`pip install megatron-fp4[verl]` (or `pip install verl`)") from err

# first: verl's engine modules resolve the platform when imported (VERL_PLATFORM=cpu needs it registered)
from megatron_fp4.verl.platform import PlatformCPU  # noqa: I001
from megatron_fp4.verl.checkpoint_engine import MegatronFP4CheckpointEngine, WeightStream
from megatron_fp4.verl.construct import MegatronFP4EngineConfig, config_from_verl
from megatron_fp4.verl.engine import MegatronFP4Engine
from megatron_fp4.verl.losses import make_policy_loss_fn
from megatron_fp4.verl.rollout import MegatronFP4Rollout
from megatron_fp4.verl.replica import MegatronFP4Replica, MegatronFP4Server
from megatron_fp4.rl.algo.is_correction import policy_loss, truncated_is_weights

BACKEND = "megatron_fp4"

__all__ = ["BACKEND", "MegatronFP4CheckpointEngine", "WeightStream", "MegatronFP4Engine", "MegatronFP4EngineConfig",
           "config_from_verl", "MegatronFP4Rollout", "MegatronFP4Replica", "MegatronFP4Server", "PlatformCPU",
           "make_policy_loss_fn", "truncated_is_weights", "policy_loss"]
