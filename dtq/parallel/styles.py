"""Tensor-parallel styles for dtq modules, for ``torch.distributed.tensor.parallel.parallelize_module``.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear`` / ``nn.Embedding``,
and would gather activations in high precision. These styles shard a dtq module's GEMM weights as
DTensors on the TP mesh (so FSDP2 on a 2-D mesh and DCP see ordinary DTensor parameters) and make
the module run its GEMMs on local shards, with the communication inside the GEMM: under sequence
parallelism the input of a column GEMM and the gradient of a row GEMM are gathered in their
quantized form (``dtq.parallel.gather_along_first_dim``), and the partial outputs / input
gradients are reduce-scattered in high precision.

Sequence parallelism splits activations along dim 0 (sequence-first ``[S, B, H]`` or flattened
tokens ``[T, H]``); a norm outside a dtq module takes torch's ``SequenceParallel(sequence_dim=0)``.
Batch-first activations ``[B, S, H]`` take ``sequence_dim=1``: the style moves that dim to the
front around the module (dtq's gathers and reduce-scatters concatenate dim-0 rows) and back.
Apply the styles to high-precision weights, then quantize them if wanted
(``dtq.convert(model, recipe=..., quantized_params=True)`` after ``parallelize_module``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from dtq.distributed import comm
from dtq.distributed.tp import TPSpec
from dtq.distributed.world import check_launched_world
from dtq.nn.layernorm import LayerNormLinear, LayerNormMLP, _Norm
from dtq.nn.linear import Linear
from dtq.tensor import QuantizedTensor
from dtq.weights import HighPrecisionWeight, unwrap


def _distribute(module: torch.nn.Module, pname: str, mesh: DeviceMesh, placement) -> None:
    """Replace parameter ``pname`` by a DTensor with ``placement`` on ``mesh`` holding this rank's
    piece of rank 0's values (a high-precision GEMM weight keeps its FSDP2 gather extension)."""
    check_launched_world()
    p = module._parameters.get(pname)
    if p is None or isinstance(p, DTensor):
        return
    data = unwrap(p.detach())
    if isinstance(data, QuantizedTensor):
        raise TypeError(
            f"dtq TP styles: {type(module).__name__}.{pname} is already a QuantizedTensor; apply the TP "
            "styles to high-precision weights and quantize afterwards (dtq.convert(model, recipe=..., "
            "quantized_params=True) after parallelize_module)"
        )
    world, rank = mesh.size(), mesh.get_local_rank()
    full = data.detach()
    if full.device.type not in ("meta", mesh.device_type):
        raise ValueError(
            f"dtq TP styles: {type(module).__name__}.{pname} is on {full.device} but the TP mesh is on "
            f"{mesh.device_type}; move the module to the mesh's device before parallelize_module"
        )
    if full.device.type != "meta" and world > 1:
        full = full.contiguous().clone()
        dist.broadcast(full, group_src=0, group=mesh.get_group())  # one source of truth, like distribute_tensor
    if isinstance(placement, Shard):
        size = full.shape[placement.dim]
        if size % world:
            raise ValueError(
                f"dtq TP styles: {type(module).__name__} {getattr(module, 'name', '')!r}.{pname} of shape "
                f"{list(full.shape)} cannot be split evenly along dim {placement.dim} over {world} "
                f"tensor-parallel ranks; use sizes divisible by the TP size"
            )
        local = full.chunk(world, dim=placement.dim)[rank].contiguous()
    else:
        local = full
    if isinstance(p, HighPrecisionWeight):
        local = HighPrecisionWeight.wrap(local)
    dt = DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())
    module._parameters[pname] = torch.nn.Parameter(dt, requires_grad=p.requires_grad)


def _replicate_norm(norm: _Norm, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    for pname in ("weight", "bias"):
        _distribute(norm, pname, mesh, Replicate())
    norm.set_tensor_parallel(mesh, sequence_parallel)


def _normalized(placement, ndim: int):
    return Shard(placement.dim % ndim) if isinstance(placement, Shard) else placement


def _to_local(x, mesh: DeviceMesh, placement):
    if isinstance(x, DTensor):
        if tuple(_normalized(p, x.ndim) for p in x.placements) != (_normalized(placement, x.ndim),):
            # a high-precision collective: counted, warned
            comm.record_fallback(
                x.dtype,
                x.numel() * x.element_size(),
                "a tensor-parallel module's input",
                f"it arrived as a DTensor with placements {tuple(x.placements)} and is redistributed "
                f"to {placement}; pass the layout the style expects",
            )
            x = x.redistribute(mesh, [placement])
        return x.to_local()
    return x


def _sequence_dim(style: _DtqStyle, module: torch.nn.Module, x: torch.Tensor) -> int:
    """``style.sequence_dim`` as a dim of ``x`` (which must have one besides its features)."""
    dim = style.sequence_dim % x.ndim if x.ndim else 0
    if x.ndim < 2 or dim == x.ndim - 1:
        raise ValueError(
            f"dtq.parallel.{type(style).__name__}(sequence_dim={style.sequence_dim}): the input of "
            f"{type(module).__name__} {getattr(module, 'name', '')!r} has shape {list(x.shape)}, whose dim "
            f"{dim} is its feature dim; sequence_dim names the sequence dim ([S, B, H]: 0, [B, S, H]: 1)"
        )
    return dim


class _DtqStyle(ParallelStyle):
    """Shared plumbing: input layout in, output layout out. ``weight_dims``: the dim of each GEMM
    weight the style splits over the mesh (0: output features, 1: input features), which also
    gives the shapes a rank's GEMMs see before the style is applied (e.g. for shape checks).
    ``sequence_dim``: the dim sequence parallelism splits (0: ``[S, B, H]`` or ``[T, H]``; 1:
    ``[B, S, H]``, moved to the front around the module, a copy when B > 1)."""

    accepts: tuple[type, ...] = ()
    weight_dims: Mapping[str, int] = MappingProxyType({})

    def __init__(self, *, sequence_parallel: bool = False, sequence_dim: int = 0, use_local_output: bool = True):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _check(self, module: torch.nn.Module) -> None:
        # a subclass that keeps the forward (torchtitan's DtqLinear) runs the same GEMMs
        if not any(isinstance(module, c) and type(module).forward is c.forward for c in self.accepts):
            names = ", ".join(f"dtq.nn.{c.__name__}" for c in self.accepts)
            raise TypeError(
                f"dtq.parallel.{type(self).__name__} applies to {names}, not {type(module).__name__}; "
                "convert nn.Linear modules with dtq.convert first, and use torch's SequenceParallel for "
                "stand-alone norms"
            )

    def _distribute_weights(self, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        for name, dim in self.weight_dims.items():
            _distribute(module, name, mesh, Shard(dim))

    def _input_placement(self):
        raise NotImplementedError

    def _output_placement(self):
        raise NotImplementedError

    def _hooks(self, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        inp, out = self._input_placement(), self._output_placement()
        moves = self.sequence_parallel and self.sequence_dim != 0

        def pre(mod, args, kwargs):
            if args:
                x = _to_local(args[0], mesh, inp)
                if moves:  # the module gathers / reduce-scatters dim-0 rows: the sequence goes first
                    x = x.movedim(_sequence_dim(self, mod, x), 0)
                args = (x, *args[1:])
            return args, kwargs

        def post(mod, args, output):
            if moves:
                output = output.movedim(0, _sequence_dim(self, mod, output))
            if self.use_local_output:
                return output
            return DTensor.from_local(output, mesh, [out], run_check=False)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)


class ColwiseParallel(_DtqStyle):
    """Shard the output features of a ``dtq.nn.Linear`` / ``LayerNormLinear`` (weight and bias
    ``Shard(0)``, a fused norm replicated). Input: replicated, or this rank's sequence shard with
    ``sequence_parallel=True`` (then gathered quantized inside the GEMM). Output: the local
    feature shard (a ``Shard(-1)`` DTensor if ``use_local_output=False``)."""

    accepts = (Linear, LayerNormLinear)
    weight_dims = MappingProxyType({"weight": 0})

    def _input_placement(self):
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _output_placement(self):
        return Shard(-1)

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        self._check(module)
        self._distribute_weights(module, device_mesh)
        _distribute(module, "bias", device_mesh, Shard(0))
        if isinstance(module, LayerNormLinear):
            _replicate_norm(module.norm, device_mesh, self.sequence_parallel)
        module.gemm_state.set_tensor_parallel({0: TPSpec("column", self.sequence_parallel)}, device_mesh)
        self._hooks(module, device_mesh)
        return module


class RowwiseParallel(_DtqStyle):
    """Shard the input features of a ``dtq.nn.Linear`` (weight ``Shard(1)``, bias replicated).
    Input: the local feature shard (a column-parallel output). Output: summed over the group —
    replicated, or reduce-scattered to this rank's sequence shard with ``sequence_parallel=True``
    (then the gradient is gathered quantized inside the GEMM)."""

    accepts = (Linear,)
    weight_dims = MappingProxyType({"weight": 1})

    def _input_placement(self):
        return Shard(-1)

    def _output_placement(self):
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        self._check(module)
        self._distribute_weights(module, device_mesh)
        _distribute(module, "bias", device_mesh, Replicate())
        module.gemm_state.set_tensor_parallel({0: TPSpec("row", self.sequence_parallel)}, device_mesh)
        self._hooks(module, device_mesh)
        return module


class LayerNormMLPParallel(_DtqStyle):
    """A ``dtq.nn.LayerNormMLP`` as a column GEMM (fc1) feeding a row GEMM (fc2): the intermediate
    activation never leaves the rank. Input and output as ``ColwiseParallel``'s input and
    ``RowwiseParallel``'s output. SwiGLU needs ``LayerNormMLP(..., swiglu_interleave=B)`` so that
    each fc1 shard holds matching gate/up rows."""

    accepts = (LayerNormMLP,)
    weight_dims = MappingProxyType({"fc1_weight": 0, "fc2_weight": 1})

    def _input_placement(self):
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _output_placement(self):
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        self._check(module)
        world = device_mesh.size()
        if module.activation == "swiglu":
            ffn = module.fc2_weight.shape[1]
            if module.swiglu_interleave is None or (ffn // world) % module.swiglu_interleave:
                raise ValueError(
                    f"dtq.parallel.LayerNormMLPParallel: {module.name!r} uses SwiGLU with "
                    f"swiglu_interleave={module.swiglu_interleave}; tensor parallelism over {world} ranks "
                    f"needs LayerNormMLP(..., swiglu_interleave=B) with B dividing ffn_hidden_size / "
                    f"{world} = {ffn / world:g}, so every fc1 shard holds whole gate/up pairs"
                )
        self._distribute_weights(module, device_mesh)
        _distribute(module, "fc1_bias", device_mesh, Shard(0))
        _distribute(module, "fc2_bias", device_mesh, Replicate())
        _replicate_norm(module.norm, device_mesh, self.sequence_parallel)
        module.gemm_state.set_tensor_parallel(
            {0: TPSpec("column", self.sequence_parallel), 1: TPSpec("row", self.sequence_parallel)}, device_mesh
        )
        self._hooks(module, device_mesh)
        return module


__all__ = ["ColwiseParallel", "RowwiseParallel", "LayerNormMLPParallel"]
