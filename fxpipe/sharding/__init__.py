"""FairScale's sharding API over torch's own machinery: a FairScale script ports by changing its imports.

=====================================================  ==================================================
FairScale                                              fxpipe.sharding, built on
=====================================================  ==================================================
``fairscale.optim.oss.OSS``                            ``OSS``: ``ZeroRedundancyOptimizer`` (ZeRO-1)
``fairscale.nn.data_parallel.ShardedDataParallel``     ``ShardedDataParallel``: FSDP2 ``fully_shard``,
                                                       ``reshard_after_forward=False`` (ZeRO-2)
``fairscale.nn.data_parallel.FullyShardedDataParallel``  ``FullyShardedDataParallel``: ``fully_shard`` (ZeRO-3)
``fairscale.optim.grad_scaler.ShardedGradScaler``      ``ShardedGradScaler``: torch's sharded ``GradScaler``
``fairscale.nn.wrap.enable_wrap / wrap / auto_wrap``   the same names (``default_auto_wrap_policy`` too)
=====================================================  ==================================================

Example (FairScale's own, with only the imports changed)::

    from fxpipe.sharding import OSS, ShardedDataParallel as ShardedDDP

    optimizer = OSS(params=model.parameters(), optim=torch.optim.SGD, lr=1e-4)
    model = ShardedDDP(model, optimizer)

The wrappers shard the module in place and return it (Note [sharded in place] in
``fsdp.py``). FairScale arguments that torch's machinery has no counterpart for are a
``ConfigError`` naming them when set, never ignored. Runnable ports of FairScale's
examples are in examples/fairscale_scripts/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports

if TYPE_CHECKING:
    from fxpipe.sharding.fsdp import FullyShardedDataParallel, ShardedDataParallel
    from fxpipe.sharding.oss import OSS
    from fxpipe.runtime.pipeline.grad_scaler import ShardedGradScaler
    from fxpipe.sharding.wrapping import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
