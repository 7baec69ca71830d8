"""``zeroshard.ZeroOptimizer``: a ``torch.optim.Optimizer`` whose work runs in C++.

The Python object owns ``param_groups`` (so ``torch.optim.lr_scheduler`` and
edits of ``param_groups[i]["lr"]`` work unchanged) and hands the current
hyper-parameters to the C++ core at every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.checkpointing import _LIVE, OptimizerCheckpointing, public_call
from zeroshard.grad_scaler import GradScalerProtocol
from zeroshard.groups import data_parallel_groups, store_of
from zeroshard.host_channel import add_host_backend
from zeroshard.measurements import OptimizerMeasurements
from zeroshard.offload import aio_options, offload_options
from zeroshard.optimizer_arguments import (
    _DEFAULTS,
    _ZERO_DEFAULTS,
    _checkpoint_prefix,
    _document_scalar_options,
    _failure_prefix,
    _group_param_names,
    _plain,
    _scalar_zero_options,
    _unknown_keywords_message,
)
from zeroshard.rule_choice import (
    builtin_class,
    group_rule,
    make_rule,
    refuse_missing,
    refuse_unknown_keys,
    refuse_whole_parameters,
    update_rule_of,
)
from zeroshard.sharded_parameter import adopt_sharded_parameters
from zeroshard.sharded_state import ShardedOptimizerState, state_range
from zeroshard.teardown import release_pinned_default_groups
from zeroshard.tensor_parallel import TensorParallelParameters
from zeroshard.units import materialize, plan_units, register_hooks


@_document_scalar_options
class ZeroOptimizer(
    OptimizerMeasurements, OptimizerCheckpointing, GradScalerProtocol, torch.optim.Optimizer
):
    """ZeRO optimizer: shards the optimizer state across the ranks of a process group.

    Args:
        params: parameters or parameter-group dicts, as for any torch.optim
            optimizer, named or not: ``model.named_parameters()`` (or groups
            of ``(name, parameter)`` pairs) name the parameters in
            checkpoints, ``full_state_dict()`` and messages, as ``module=``
            does; ``param_names=`` or ``module=``, when given, name them
            instead.
        optimizer: the inner optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (the
            core's C++ kernels), or a ``torch.optim.Optimizer`` subclass whose
            state is per element (``zeroshard.update_rules``): elementwise
            ones (``torch.optim.RAdam``, ``Adagrad``, ``RMSprop``, ``NAdam``,
            a third-party Lion) run on this rank's pieces of the parameters,
            others (``torch.optim.Muon``; ``torch.optim.Adafactor``, whose
            factored states the owner keeps in their shapes) on whole
            parameters, each owned by one rank. ``torch.optim.Adam``,
            ``AdamW`` and ``SGD`` with hyper-parameters the kernels take run
            as the built-in names. Classes with a closure (LBFGS), state
            outside ``optimizer.state[p]`` or coupled parameters are refused,
            naming them. A parameter group may name its own with an
            ``"optimizer"`` key. With ``offload_optimizer``, "cpu" only.
        <the scalar ZeRO options: _document_scalar_options fills them in>
        process_group: the group to shard over; the default group when None
            (``torch.distributed.init_process_group`` must have been called).
        device_mesh: instead of ``process_group``: a 1-D ``DeviceMesh`` to
            shard over, or a 2-D one read as (replicate, shard) for hybrid
            sharding (FSDP2's HSDP), dimensions named ``"replicate"`` /
            ``"shard"`` (or ``"dp_replicate"`` / ``"dp_shard"``) or unnamed.
        replicate_group: hybrid sharding with ``process_group`` as the shard
            group: the ranks holding the same shard in the other shard groups.
            Gradients are reduce-scattered within the shard group and their
            shards all-reduced across replicas; parameters are all-gathered
            within the shard group only (see ``zeroshard.groups.hybrid_groups``).
        module: the model. Stage 3 needs it (hooks are registered on its
            submodules); at every stage it names ``full_state_dict()``'s keys.
        unit_classes: stage 3: module classes gathered as one unit (e.g. a
            transformer block). Other modules owning parameters directly are
            units of their own parameters.
        param_init_fn: stage 3 with parameters on the meta device: initializes
            one module's direct parameters in place, called in
            ``Module.apply`` order (default: ``module.reset_parameters()``).
        materialize_device: stage 3: where meta parameters are materialized.
        offload_optimizer: where the optimizer state (fp32 master, moments)
            and the step live: ``"cpu"`` or DeepSpeed's section as a dict
            (``{"device": "cpu", "ratio": 0.5}``, or
            ``{"device": "nvme", "nvme_path": "/local_nvme"}``
            for a swap file per rank, read and written sub-group by sub-group;
            add ``"swap_gradients": True`` at stages 2-3 to put the fp32
            gradient shard there too, written as it is reduced); None or
            ``"none"`` keeps them on the device. Any stage.
        offload_param: stage 3: parameter shards in host memory, copied to the
            device ahead of each unit's all-gather (``"cpu"`` or a dict with
            DeepSpeed's offload_param keys), or in a swap file per rank with
            ``{"device": "nvme", "nvme_path": ...}``: read ahead of each
            all-gather in the previous iteration's order (at most
            ``buffer_count`` buckets of at most ``buffer_size`` elements),
            the first ``max_in_cpu`` elements kept in host memory. Needs
            ``offload_optimizer``. Every key of both sections and its
            default: docs/offload.md, or ``zeroshard._C.offload_option_keys()``
            (the core's one list).
        aio: NVMe I/O settings, DeepSpeed's ``aio`` section (``block_size``,
            ``queue_depth``, ``intra_op_parallelism``, ``single_submit``,
            ``overlap_events``) plus ``use_io_uring`` (False: the thread pool).
        failure_report_seconds: when a collective fails (a rank was killed or
            stalls past the process group's timeout), how long this rank waits
            for the others to report the failure through the group's store;
            the error names the ranks that did not.
        expert_parallel_group: for an optimizer of expert parameters under
            expert parallelism (each rank of this group holds other experts;
            ``process_group`` is the expert-data-parallel group, the ranks
            holding the same experts): the gradient norm adds the experts of
            every rank of the group. Set ``gradient_divide_factor`` to the
            whole data-parallel world and clip dense and expert optimizers
            together with :func:`zeroshard.clip_grad_norm_`. Its gradients
            are reduced in ``step()`` (they stay in ``.grad`` until then).
            At stage 3 pass ``module=`` the model and make the MoE block one
            unit (recognised by class name, else ``unit_classes=``): entering
            it gathers all of this rank's experts, used or not, so every rank
            of the expert-data-parallel group gathers alike.
        ignored_params: stage 3: parameters of ``module`` another optimizer
            holds (FSDP's name): the dense optimizer of a MoE model lists the
            experts here. This optimizer's units leave them alone.
        param_names: ``{name: parameter}`` naming parameters in checkpoints
            and ``full_state_dict()`` instead of ``module``'s names. An expert
            optimizer needs it to save: names must say which expert a tensor
            is across expert-parallel ranks (``"layers.0.expert5.w1"``, not
            the local ``"experts.1.w1"``); the checkpoint then loads at any
            expert-parallel degree.
        **optimizer_kwargs: the inner optimizer's hyper-parameters (lr, betas,
            eps, weight_decay, amsgrad; or lr, momentum, dampening,
            weight_decay, nesterov for SGD; a class's own keywords).

    Every rank must construct it with the same parameters and call ``step()``
    together. The model's parameters become views into one flat buffer per
    group; they keep their values, shapes and identities.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer: str = "adamw",
        stage: int = _ZERO_DEFAULTS["stage"],
        process_group: dist.ProcessGroup | None = None,
        *,
        device_mesh: Any = None,
        replicate_group: dist.ProcessGroup | None = None,
        module: torch.nn.Module | None = None,
        unit_classes: Sequence[type[torch.nn.Module]] = (),
        param_init_fn: Callable[[torch.nn.Module], None] | None = None,
        materialize_device: str | torch.device = "cpu",
        reduce_bucket_size: int = _ZERO_DEFAULTS["reduce_bucket_size"],
        broadcast_from_rank: int = _ZERO_DEFAULTS["broadcast_from_rank"],
        max_norm: float | None = None,
        max_buckets_in_flight: int = _ZERO_DEFAULTS["max_buckets_in_flight"],
        overlap_comm: bool = _ZERO_DEFAULTS["overlap_comm"],
        fused: bool = _ZERO_DEFAULTS["fused"],
        stage3_prefetch_bucket_size: int = _ZERO_DEFAULTS["stage3_prefetch_bucket_size"],
        stage3_param_persistence_threshold: int = _ZERO_DEFAULTS[
            "stage3_param_persistence_threshold"
        ],
        stage3_max_live_parameters: int = _ZERO_DEFAULTS["stage3_max_live_parameters"],
        check_collective_order: bool = _ZERO_DEFAULTS["check_collective_order"],
        skip_nonfinite_steps: bool = _ZERO_DEFAULTS["skip_nonfinite_steps"],
        reduce_in_fp32: bool = _ZERO_DEFAULTS["reduce_in_fp32"],
        gloo_reduce_scatter_all_to_all: bool = _ZERO_DEFAULTS["gloo_reduce_scatter_all_to_all"],
        gloo_all_gather_broadcasts: bool = _ZERO_DEFAULTS["gloo_all_gather_broadcasts"],
        stage1_reduce_in_backward: bool = _ZERO_DEFAULTS["stage1_reduce_in_backward"],
        offload_optimizer: str | Mapping[str, Any] | None = None,
        offload_param: str | Mapping[str, Any] | None = None,
        sub_group_size: int = _ZERO_DEFAULTS["sub_group_size"],
        aio: Mapping[str, Any] | None = None,
        failure_report_seconds: float = 3.0,
        gradient_divide_factor: float | None = None,
        expert_parallel_group: dist.ProcessGroup | None = None,
        ignored_params: Iterable[torch.Tensor] | None = None,
        param_names: Mapping[str, torch.Tensor] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        scalar_options = _scalar_zero_options(locals())
        kind, rule, accepted = update_rule_of(optimizer, optimizer_kwargs, _DEFAULTS)
        unknown = set(optimizer_kwargs) - set(accepted)
        if unknown:
            raise TypeError(
                _unknown_keywords_message(sorted(unknown), kind, ZeroOptimizer.__init__, accepted)
            )
        defaults = dict(accepted, **optimizer_kwargs)
        refuse_missing(kind, defaults, defaults)
        self._impl: Any = None
        # Per group: its own rule and hyper-parameter names, from a group's
        # "optimizer" key (add_param_group), else None.
        self._group_rules: list[tuple[Any, list[str], type] | None] = []
        super().__init__(params, defaults)
        release_pinned_default_groups()  # see [Note: the default group pinned by default arguments]
        if any(own is not None for own in self._group_rules) and rule is None:
            # Groups with rules of their own: the others run optimizer= as
            # torch's class on pieces too (one kind of update in the core).
            rule = make_rule(builtin_class(kind))
        self._rules: list[Any] | None = (
            None if rule is None else [own[0] if own else rule for own in self._group_rules]
        )
        self._group_keys = [own[1] if own else list(accepted) for own in self._group_rules]
        refuse_unknown_keys(self.param_groups, self._group_keys, kind)
        groups = data_parallel_groups(process_group, device_mesh, replicate_group)
        process_group = groups.shard
        if stage == 3 and module is None:
            raise ValueError(
                "stage 3 needs module=<the model>: its parameters are gathered by hooks on "
                "the model's submodules"
            )
        if stage != 3 and (unit_classes or param_init_fn is not None or ignored_params):
            raise ValueError(
                "unit_classes=, param_init_fn= and ignored_params= are stage 3 options; "
                f"stage is {stage}"
            )
        ignored = {id(p) for p in ignored_params or ()}
        self._kind = kind
        self._rule = rule  # optimizer='s Python update rule (None: a built-in one)
        self._stage = stage
        self._process_group = process_group
        self._replicate_group = groups.replicate
        self._module = module
        units = (
            self._plan_units(module, unit_classes, ignored, expert_parallel_group is not None)
            if stage == 3 and module is not None
            else []
        )
        self._units = units
        # DTensor parameters (PyTorch TP): the core shards their local tensors.
        tp = TensorParallelParameters(self.param_groups)
        self._tensor_parallel = tp
        if tp.active and self._rules is not None:
            refuse_whole_parameters(self._rules, self._hyperparameters(), "tensor-parallel")
        zero_options = {
            **scalar_options,
            "offload_optimizer": offload_options(offload_optimizer, "offload_optimizer"),
            "offload_param": offload_options(offload_param, "offload_param"),
            "aio": aio_options(aio),
            "materialize_device": str(torch.device(materialize_device)),
        }
        # [Note: the host channel]: NCCL groups get a Gloo backend for the
        # agreements' host tensors, before the core picks its channels.
        for group in (process_group, groups.replicate, expert_parallel_group):
            if group is not None:
                add_host_backend(group)
        self._impl = _C.ZeroOptimizer(
            [tp.locals(group["params"]) for group in self.param_groups],
            process_group,
            kind if self._rules is None else self._rules,
            self._hyperparameters(),
            zero_options,
            [(unit.name, tp.locals(unit.params)) for unit in units],
            groups.replicate,
        )
        store = store_of(process_group)
        if store is not None:
            self._impl.set_failure_store(
                store, _failure_prefix(process_group), float(failure_report_seconds)
            )
        # Asynchronous saves agree on their commit through a store every rank
        # of the checkpoint reaches (the shard group's does not span tensor-
        # parallel ranks or replicas): the default group's.
        world_store = store_of(dist.group.WORLD) if dist.is_initialized() else None
        if world_store is not None:
            self._impl.set_checkpoint_store(world_store, _checkpoint_prefix())
        replica_store = store_of(groups.replicate) if groups.replicate is not None else None
        if replica_store is not None:
            self._impl.set_replica_failure_store(
                replica_store, _failure_prefix(groups.replicate), float(failure_report_seconds)
            )
        # Checkpoints store states by these names (tied weights: every name).
        self._param_names = (
            list(param_names.items())
            if param_names is not None
            else list(module.named_parameters(remove_duplicate=False))
            if module is not None
            else _group_param_names(self.param_groups)
        )
        if self._param_names is not None:
            self._impl.set_parameter_names([(name, tp.local(p)) for name, p in self._param_names])
        # torch.optim's optimizer.state[p]: this rank's part (sharded_state.py).
        self.state = ShardedOptimizerState(self)  # type: ignore[assignment]
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        _LIVE.add(self)  # with its _hook_handles: see _release_at_exit
        self._gradient_handles = tp.attach(self, self._impl, stage)
        self._skip_nonfinite_steps = bool(skip_nonfinite_steps)
        self._clipped_since_step = False
        if expert_parallel_group is not None:
            if tp.active:
                raise ValueError(
                    "expert_parallel_group= and tensor-parallel (DTensor) parameters in one "
                    "optimizer are not supported; give the experts an optimizer of their own"
                )
            # Each rank's experts are other tensors: their norms add up over
            # the group, a non-finite gradient anywhere skips every rank.
            self._impl.set_expert_parallel(expert_parallel_group)
            # Expert gradients are reduced in step(), never from backward
            # hooks: which experts a rank's tokens reach differs between
            # ranks, so the order in which this optimizer's and the dense
            # optimizer's hooks fire does too, and collectives of the two
            # issued in different orders on different ranks would deadlock.
            self._impl.set_gradient_sync(False)
        if stage == 3:
            assert module is not None
            if any(p.is_meta for group in self.param_groups for p in group["params"]):
                before = [p for group in self.param_groups for p in group["params"]]
                materialize(self._impl, module, self.param_groups, param_init_fn)
                # The names follow the parameters materialize put in their place.
                after = {
                    id(old): new
                    for old, new in zip(
                        before,
                        (p for group in self.param_groups for p in group["params"]),
                        strict=True,
                    )
                }
                if self._param_names is not None:
                    self._param_names = [(n, after.get(id(p), p)) for n, p in self._param_names]
                # Now over the real parameters.
                units = self._plan_units(
                    module, unit_classes, ignored, expert_parallel_group is not None
                )
                self._units = units
            self._hook_handles = register_hooks(self._impl, units, module)
            # [Note: a released parameter refuses reads]
            mine = {id(p) for group in self.param_groups for p in group["params"]}
            named = self._param_names or []
            adopt_sharded_parameters((n, p) for n, p in named if id(p) in mine)
        if tp.active and any(p.is_meta for group in self.param_groups for p in group["params"]):
            raise ValueError("tensor-parallel (DTensor) models must be materialized first")
        # Whose parameters torch.nn.utils.clip_grad_norm_ routes here ([Note:
        # torch's clip_grad_norm_ routed] in clipping.py).
        self._param_ids = frozenset(id(p) for group in self.param_groups for p in group["params"])
        self._ignored = ignored
        if module is not None and expert_parallel_group is None:
            self.broadcast_buffers(module)

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Collective: ``module``'s buffers take ``broadcast_from_rank``'s values on every rank.

        As ``DistributedDataParallel`` does when it wraps a model: a buffer
        initialised differently on each rank (an unseeded random init) would
        otherwise stay different. Construction with ``module=`` does it (not
        for an ``expert_parallel_group`` optimizer, whose ranks hold other
        experts); an optimizer built without ``module=`` leaves buffers as
        they are, so call this once after construction. Buffers of modules
        whose parameters are all in ``ignored_params`` (another optimizer's,
        such as the experts') are left alone.
        """
        seen: set[int] = set()
        buffers = []
        for submodule in module.modules():
            direct = list(submodule.parameters(recurse=False))
            if direct and all(id(p) in self._ignored for p in direct):
                continue
            for buffer in submodule.buffers(recurse=False):
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    buffers.append(buffer)
        self._impl.broadcast_buffers(buffers)

    def name_parameters(self, module: torch.nn.Module) -> None:
        """Names the parameters after ``module.named_parameters()`` (tied ones under
        every name): checkpoint keys and ``full_state_dict()`` keys, as ``module=``
        does at construction. A no-op where the optimizer has names already."""
        if self._param_names is not None:
            return
        self._param_names = list(module.named_parameters(remove_duplicate=False))
        tp = self._tensor_parallel
        self._impl.set_parameter_names([(name, tp.local(p)) for name, p in self._param_names])

    def state_range(self, p: torch.Tensor) -> tuple[int, int]:
        """``[start, end)``: the elements of ``p.flatten()`` whose optimizer state
        this rank holds, those ``optimizer.state[p]`` returns (``start == end``
        where it owns none). For a tensor-parallel (DTensor) parameter, of its
        local tensor. Local: no collective."""
        where = self.state._where(p)
        if where is None:
            raise KeyError("state_range(p): p is not a parameter of this ZeroOptimizer")
        return state_range(self._impl, where)

    def _plan_units(
        self,
        module: torch.nn.Module,
        unit_classes: Sequence[type[torch.nn.Module]],
        ignored: set[int],
        experts: bool,
    ) -> list[Any]:
        """Stage 3's units over this optimizer's parameters of ``module``.

        A parameter of ``module`` this optimizer does not hold must be in
        ``ignored_params`` (another optimizer's, such as the experts'), except
        for an expert optimizer, which by definition holds only the experts.
        """
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        if not experts:
            stray = [
                name
                for name, p in module.named_parameters()
                if id(p) not in mine and id(p) not in ignored
            ]
            if stray:
                raise ValueError(
                    f"stage 3: {len(stray)} parameters of module= are not in this optimizer, "
                    f"first {stray[:5]}; pass every parameter of the model, or list the ones "
                    "another optimizer holds (e.g. the experts') in ignored_params="
                )
        return plan_units(module, unit_classes, owned=mine)

    def _hyperparameters(self) -> list[dict[str, Any]]:
        return [
            {k: _plain(group[k]) for k in keys}
            for group, keys in zip(self.param_groups, self._group_keys, strict=True)
        ]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group during construction; afterwards the layout is fixed."""
        if getattr(self, "_impl", None) is not None:
            raise RuntimeError(
                "zeroshard.ZeroOptimizer cannot add parameter groups after construction: "
                "the partition layout is fixed; pass all groups to the constructor"
            )
        if "optimizer" not in param_group:
            self._group_rules.append(None)
            super().add_param_group(param_group)
            return
        # A group's own update rule: its class's defaults, not optimizer='s.
        own = group_rule(param_group, [r for r in self._group_rules if r is not None])
        self._group_rules.append(own)
        super().add_param_group(param_group)
        # torch.optim filled in optimizer='s defaults as well: not this group's.
        for key in set(self.defaults) - set(own[1]) - {"params"}:
            param_group.pop(key, None)

    # torch.amp.GradScaler hands itself to step() instead of unscaling .grad,
    # which stages 2 and 3 have reduced into the shard and freed.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> float | None:
        """Collective: averages gradients across ranks and updates the parameters.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step(optimizer)``
        (this optimizer unscales its own gradients, as torch's fused ones do):
        the averaged gradients are divided by the scale, and the step is
        skipped on every rank when any rank's hold inf/NaN; the scaler then
        learns that verdict, so every rank's ``scaler.update()`` moves the
        scale alike. Call ``scaler.step(optimizer)`` on every rank.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None:
            self._unscale_for(grad_scaler)
        try:
            with public_call(self._impl, "step"):
                self._impl.set_hyperparameters(self._hyperparameters())
                self._impl.step()
        except RuntimeError as error:
            # A failed collective is DistBackendError wherever it surfaces
            # (autograd already translates those raised in backward hooks).
            if isinstance(error, dist.DistBackendError) or not str(error).startswith(
                "zeroshard: rank "
            ):
                raise
            raise dist.DistBackendError(str(error)) from None
        finally:
            self._clipped_since_step = False
        if grad_scaler is not None:
            self._record_found_inf(grad_scaler)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` of every parameter and, at stage 2, the gradient shard."""
        super().zero_grad(set_to_none)
        if self._impl is not None:
            self._impl.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Collective: clips the gradients to a global L2 norm; returns the total norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Call it
        between backward and ``step()`` on every rank (at stage 2 ``.grad`` is
        released, so ``torch.nn.utils.clip_grad_norm_`` would see no gradients).
        """
        self._clipped_since_step = True
        return self._impl.clip_grad_norm(float(max_norm))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into ``.grad`` with no communication.

        As ``DistributedDataParallel.no_sync``: use it for the micro-steps before
        an accumulation boundary; the first backward outside it (or ``step()``)
        reduces everything accumulated. Costs a full gradient's memory meanwhile.
        """
        previous = self._impl.gradient_sync()
        self._impl.set_gradient_sync(False)
        try:
            yield
        finally:
            self._impl.set_gradient_sync(previous)

    # Gathering on demand ---------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(
        self,
        params: Iterable[torch.Tensor] | None = None,
        modifier_rank: int | None = None,
    ) -> Iterator[None]:
        """Collective: inside the block, ``params`` (all when None) hold their full values.

        At stage 3 their units are gathered on entry and released on exit; at
        stages 1 and 2 parameters are always whole. With ``modifier_rank``,
        that rank's in-place edits made inside the block are broadcast on exit
        and kept (they become the master weights), as DeepSpeed's
        ``GatheredParameters(modifier_rank=...)``.
        """
        chosen = self._tensor_parallel.locals(params) if params is not None else []
        self._impl.pin_parameters(chosen)
        try:
            yield
        finally:
            self._impl.unpin_parameters(chosen, -1 if modifier_rank is None else modifier_rank)

    def _release_at_exit(self) -> None:
        """See [Note: release at exit] in checkpointing.py; unusable afterwards."""
        self.remove_hooks()
        self._impl = None
        self._process_group = None
        self._replicate_group = None

    def remove_hooks(self) -> None:
        """Stage 3: detaches the module hooks (the model can no longer run)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    @property
    def units(self) -> list[str]:
        """Stage 3: the names of the gathering units, in order."""
        return [unit.name for unit in self._units]

    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` found non-finite gradients and changed nothing."""
        return bool(self._impl.last_step_skipped())
