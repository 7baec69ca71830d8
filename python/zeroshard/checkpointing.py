"""What a ZeroOptimizer saves and restores: the per-rank ``state_dict``, the
checkpoints that load at any layout, and the full model state. Mixed into
:class:`zeroshard.ZeroOptimizer`; the work runs in the C++ core
(``self._impl``)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from zeroshard.update_rules import rule_name

_STATE_KEY = "zeroshard_shard"

# Optimizers with an asynchronous save in flight: interpreter exit waits for
# them (the C++ destructor would too, but exit may not run it).
_IN_FLIGHT: weakref.WeakSet[OptimizerCheckpointing] = weakref.WeakSet()
# Every optimizer of this process: interpreter exit releases what a live one
# still holds (see [Note: release at exit]).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # ZeroOptimizer's, with _release_at_exit


@contextlib.contextmanager
def public_call(impl: Any, name: str) -> Iterator[None]:
    """Names the public call this rank is in (``impl``: the C++ core), for the
    errors that say which call each rank is in when ranks diverge: see
    [Note: Which call a rank is in] in csrc/include/zeroshard/communicator.h."""
    impl.enter_call(name)
    try:
        yield
    finally:
        impl.exit_call()


@atexit.register
def _at_exit() -> None:
    """[Note: release at exit]
    A script that keeps its optimizer, or at stage 3 any reference to the
    model (whose hooks hold the C++ optimizer), past
    ``destroy_process_group()`` keeps the group alive through the optimizer's
    communicator: Gloo's worker threads then run into interpreter
    finalization, where a worker freeing a Python-owned tensor aborts the
    process, and on NCCL the optimizer is destroyed after its communicator,
    during teardown. Here, before finalization and before C++ static
    destructors run, asynchronous saves finish, then every live optimizer
    drops its hooks, its C++ core and its groups, so that a group the script
    destroyed is freed and its threads joined now.
    """
    for optimizer in list(_IN_FLIGHT):
        try:
            optimizer._impl.wait_for_checkpoint()
        except Exception as error:  # noqa: BLE001 - exit: report and wait for the others
            print(f"[zeroshard] {error}", file=sys.stderr)
    for optimizer in list(_LIVE):
        try:
            optimizer._release_at_exit()
        except Exception as error:  # noqa: BLE001 - exit: report and release the others
            print(f"[zeroshard] releasing an optimizer at exit: {error}", file=sys.stderr)


class OptimizerCheckpointing:
    """Saving and loading of the C++ optimizer ``self._impl``."""

    _impl: Any
    _tensor_parallel: Any
    _param_names: list[tuple[str, torch.Tensor]] | None
    param_groups: list[dict[str, Any]]
    state: Any

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard plus the hyper-parameters; save one file per rank."""
        # torch.optim's state_dict would read every parameter's state
        # (optimizer.state); the shard below holds it once.
        state, self.state = self.state, {}
        try:
            base = super().state_dict()
        finally:
            self.state = state
        # A group's own optimizer class is saved by its name: a class object
        # is not something torch.load(weights_only=True) will read.
        groups = [
            {**g, "optimizer": rule_name(g["optimizer"])} if "optimizer" in g else g
            for g in base["param_groups"]
        ]
        return {"state": {}, "param_groups": groups, _STATE_KEY: self._impl.shard_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: restores a state saved by ``state_dict()`` on the same rank."""
        if _STATE_KEY not in state_dict:
            raise ValueError(
                "not a zeroshard.ZeroOptimizer state dict (no "
                f"{_STATE_KEY!r} entry); load what ZeroOptimizer.state_dict() saved"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        for index, (group, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            ours = rule_name(group["optimizer"]) if "optimizer" in group else None
            if saved.get("optimizer") != ours:
                raise ValueError(
                    f"parameter group {index} of the state dict runs "
                    f"{saved.get('optimizer') or 'optimizer='}, this optimizer's runs "
                    f"{ours or 'optimizer='}; build the optimizer with the groups it was saved with"
                )
        self._impl.load_shard_state(state_dict[_STATE_KEY])
        for group, saved in zip(self.param_groups, groups, strict=True):
            for key, value in saved.items():
                if key not in ("params", "optimizer"):
                    group[key] = value

    # Checkpoints that load at any world size and stage --------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], async_save: bool = False) -> None:
        """Collective: writes this optimizer's state as the checkpoint directory ``path``.

        Every rank writes the ranges of the fp32 master weights and moments it
        owns, keyed by parameter name (``module=``'s names, else
        ``"group{g}.{i}"``), into ``path.tmp/``; once all writes succeeded the
        directory is renamed to ``path`` atomically. Loads at any world size,
        stage, bucket size, grouping or offload setting (``load_checkpoint``).
        Tensor-parallel (DTensor) parameters are stored as unsplit tensors,
        written by every tensor-parallel rank into the same directory: the
        checkpoint loads at any tensor-parallel degree, or without TP, and
        ``python -m zeroshard consolidate`` makes whole tensors of it.
        With ``async_save`` the state is copied to host memory during the call
        and written by a C++ thread while training goes on; the next save or
        load, ``wait_for_checkpoint()`` or exit waits for it.
        """
        self._tensor_parallel.check_checkpointable()
        # The core holds the hyper-parameters of the last step(); a scheduler
        # has changed the lr since. The checkpoint keeps what the next step
        # uses (it restores them on load).
        with public_call(self._impl, "save_checkpoint"):
            self._impl.set_hyperparameters(self._hyperparameters())
            self._impl.save_checkpoint(os.fspath(path), async_save=async_save)
        if async_save:
            _IN_FLIGHT.add(self)

    def wait_for_checkpoint(self) -> None:
        """Waits for an asynchronous save; raises (on every rank) if it failed."""
        _IN_FLIGHT.discard(self)
        self._impl.wait_for_checkpoint()

    def load_checkpoint(
        self, path: str | os.PathLike[str], load_optimizer_states: bool = True
    ) -> None:
        """Collective: loads a checkpoint written by ``save_checkpoint`` (or an engine).

        Parameters are matched by name; each rank reads only the ranges it now
        owns and verifies their checksums. A mismatched model, a corrupt or a
        missing file raises ``ValueError`` on every rank before anything
        changes. With ``load_optimizer_states=False`` only the weights load.
        """
        self._tensor_parallel.check_checkpointable()
        self._impl.load_checkpoint(os.fspath(path), load_optimizer_states)
        self._sync_hyperparameters()

    def _sync_hyperparameters(self) -> None:
        # The C++ core restored the saved hyper-parameters; mirror them here,
        # since these dicts are what step() hands back to it.
        for group, values in zip(
            self.param_groups, json.loads(self._impl.group_hyperparameters()), strict=True
        ):
            for key, value in values.items():
                group[key] = tuple(value) if key == "betas" else value

    def full_state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Collective: the full fp32 model state on ``rank`` (empty dict elsewhere).

        Keys are ``param_names``' names, else ``module.named_parameters()``
        names when the optimizer knows the model, else ``"group{g}.{i}"``.
        Values are the master weights.
        """
        with public_call(self._impl, "full_state_dict"):
            full = self._impl.full_parameters(rank)
        if not full or not full[0]:
            return {}
        by_id = {
            id(p): value
            for group, values in zip(self.param_groups, full, strict=True)
            for p, value in zip(group["params"], values, strict=True)
        }
        if self._tensor_parallel.active:
            by_id = self._tensor_parallel.full_tensors(by_id)
            full = [[by_id[id(p)] for p in group["params"]] for group in self.param_groups]
        if self._param_names is not None:
            return {name: by_id[id(p)] for name, p in self._param_names if id(p) in by_id}
        return {
            f"group{g}.{i}": value
            for g, values in enumerate(full)
            for i, value in enumerate(values)
        }
