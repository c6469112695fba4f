"""``Slot``: one quantized tensor of one GEMM (its role, quantizer and delayed-scaling state), and
how it is quantized: current or delayed scaling, the amax a producer computed, the quantized
sequence-parallel gather."""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch

from dtq import kernels
from dtq._bits import stored_amax
from dtq._torch_private import checkpoint_region
from dtq.codec import COLUMNWISE, ROWWISE, shape_2d
from dtq.distributed import tp
from dtq.formats import Quantizer
from dtq.recipe import QuantizerRole
from dtq.weights import unwrap


@dataclasses.dataclass
class Slot:
    """One quantized tensor of one GEMM: its role and quantizer (None: high precision) and, under
    delayed scaling, the name of the module buffer holding its amax history."""

    role: QuantizerRole | None
    quantizer: Quantizer | None
    owner: weakref.ReferenceType | None = None
    history: str | None = None
    margin: int = 0
    most_recent: bool = False
    last_amax: torch.Tensor | None = None
    # Scales used inside torch.utils.checkpoint regions, in call order, for their recompute:
    # {region: deque of amaxes} (weak keys: a region's entries go when its graph does).
    replays: weakref.WeakKeyDictionary = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    def _delayed_amax(self, x: torch.Tensor, replay: bool, group=None, sync=None) -> torch.Tensor:
        if replay and (amax := self.replayed_amax()) is not None:
            return amax
        x = unwrap(x)  # a weight wrapper's data: the kernel needs a plain tensor, the ops run faster on one
        if group is None:
            return self._history_step(sync, x=x)
        cur = _abs_max(x)  # a sequence-parallel shard: the history tracks the whole tensor
        torch.distributed.all_reduce(cur, op=torch.distributed.ReduceOp.MAX, group=group)
        return self._history_step(sync, cur=cur)

    def delayed_amax(self, cur: torch.Tensor, sync=None) -> torch.Tensor:
        """The delayed-scaling amax for a tensor whose current amax (over the whole tensor) is
        ``cur``: from the history, which then takes ``cur`` as its newest entry."""
        return self._history_step(sync, cur=cur)

    def _history_step(self, sync, x: torch.Tensor | None = None, cur: torch.Tensor | None = None) -> torch.Tensor:
        """The amax from this slot's history, which then takes max|x| (or ``cur``) as its newest
        entry; one kernel launch where the tensors allow, else :func:`history_step`'s torch ops."""
        hist = getattr(self.owner(), self.history)  # looked up each time: .to()/.cuda() replace buffers
        # Under autocast(amax_group=...), the newest entries of this region are local until the
        # flush: the scale comes from the shared ones before them (zeros if none are left).
        skip = sync.pending(hist) if sync is not None else 0
        factor = 2.0**self.margin
        x2d = _history_kernel_input(hist, x, cur)
        if x2d is not False:
            amax, _ = kernels.delayed_amax(hist, x2d, cur, skip, self.most_recent, factor)
        else:
            amax = history_step(hist, _abs_max(x) if x is not None else cur, skip, self.most_recent, factor)
        if sync is not None:  # dtq.autocast(amax_group=...): entry 0 is reduced over the group later
            sync.add(hist)
        self.last_amax = amax
        # A forward recomputed later must see this scale, not the history's; a gradient is never
        # recomputed (its slot's replays would go unread), so backward skips the region lookup.
        if self.role is None or self.role.tensor_type != "grad_output":
            region = checkpoint_region()
            if region is not None:
                self.replays.setdefault(region, collections.deque()).append(amax)
        return amax

    def replayed_amax(self) -> torch.Tensor | None:
        """The amax of the forward call a recompute replays (the history moves once): the next one
        recorded in this checkpoint region, else the last one used."""
        region = checkpoint_region()
        queue = self.replays.get(region) if region is not None else None
        if queue:
            return queue.popleft()
        return self.last_amax

    def _known_amax(self, x: torch.Tensor, known: torch.Tensor, rowwise: bool, columnwise: bool) -> dict:
        """``{direction: known}`` for the requested directions whose scale derives from max|x|
        over the whole tensor (current scaling), where ``known`` is that value already (computed
        by the kernel that produced x)."""
        dirs = tuple(d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
        return dict.fromkeys(tensor_amax_directions(self.quantizer, dirs, shape_2d(x.shape)), known)

    def takes_tensor_amax(self) -> bool:
        """Whether a direction of this slot scales from max|x| over the whole tensor (current
        scaling), so that an amax computed ahead (by x's producer) spares its quantization a pass.
        A tensor-wide amax has shape ``()`` whatever the tensor's, hence the probe shape."""
        q = self.quantizer
        return (
            q is not None
            and self.history is None
            and any(_scales_from_tensor_amax(q.codec(d), (1, 1)) for d in (ROWWISE, COLUMNWISE))
        )

    def quantize(
        self,
        x: torch.Tensor,
        rowwise: bool,
        columnwise: bool,
        replay: bool = False,
        group=None,
        sync=None,
        known_amax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` quantized into the requested directions; with a ``group``, ``x`` is this rank's
        sequence-parallel shard and the result is the gathered whole (docs/design.md §5: quantized, with
        scales agreed across the group). ``sync``: the :class:`dtq.distributed.amax.AmaxSync` that
        reduces this step's delayed-scaling amax over the ranks sharing histories, or None.
        ``known_amax``: max|x| if the producer of x computed it (used by current scaling only)."""
        if group is not None and self.quantizer is None:
            return tp.gather_rows(x, group, reason=f"the recipe gives no quantizer for {self.role}")
        if self.quantizer is None or not (rowwise or columnwise):
            return x
        amax = self._delayed_amax(x, replay, group, sync) if self.history is not None else None
        if amax is None and group is None and known_amax is not None:
            amax = self._known_amax(x, known_amax, rowwise, columnwise) or None
        try:
            if group is None:
                return self.quantizer.quantize_data(x, rowwise=rowwise, columnwise=columnwise, amax=amax)
            dirs = [d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on]
            return tp.gather_along_first_dim(
                x,
                group,
                self.quantizer,
                rowwise=rowwise,
                columnwise=columnwise,
                amax=None if amax is None else {d: amax for d in dirs},
            )
        except ValueError as e:
            raise ValueError(f"{self.role}: {e}") from None


@torch.no_grad()
def history_step(hist: torch.Tensor, cur: torch.Tensor, skip: int, most_recent: bool, factor: float) -> torch.Tensor:
    """Delayed scaling's step of an amax history (the reference of ``dtq.kernels.delayed_amax``):
    the amax a quantization scales from, the newest entry of ``hist[skip:]`` (``most_recent``) or
    their max, times ``factor`` (2**margin), or ``cur`` on the first step (nothing recorded yet);
    then ``hist`` shifts one place towards its end and takes ``cur`` at [0]."""
    shared = hist[skip:]
    if shared.numel() == 0:
        past = torch.zeros((), dtype=hist.dtype, device=hist.device)
    else:
        past = shared[0] if most_recent else shared.amax()
    amax = torch.where(past > 0, past, cur.to(hist.device)) * factor
    hist.copy_(torch.roll(hist, 1))
    hist[0] = cur
    return amax


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """max|x| over the whole tensor, fp32 (0 for an empty one), on the stored bit patterns as the
    kernel takes it (so even a NaN's payload is the kernel's)."""
    if not x.numel():
        return torch.zeros((), device=x.device)
    return stored_amax(x.detach())


_DENSE = (torch.Tensor, torch.nn.Parameter)  # no subclass (a wrapper, a DTensor) reaches a kernel


def _history_kernel_input(hist: torch.Tensor, x: torch.Tensor | None, cur: torch.Tensor | None):
    """What ``kernels.delayed_amax`` takes as its ``x`` (x as 2-D, or None where ``cur`` is given)
    when it can run this step, else False: plain contiguous tensors on one sm_90+ CUDA device, an
    fp32 history it can hold, x of a dtype it reads or an fp32 ``cur``."""
    if not (
        type(hist) in _DENSE
        and hist.is_cuda
        and hist.dtype == torch.float32
        and hist.dim() == 1
        and hist.numel() <= kernels.MAX_HISTORY
        and hist.is_contiguous()
    ):
        return False
    t = x if x is not None else cur
    if type(t) not in _DENSE or t.device != hist.device or not t.is_contiguous():
        return False
    if x is None:
        return None if cur.dtype == torch.float32 and cur.numel() == 1 and kernels.available(hist.device) else False
    if x.dim() < 2 or not x.numel() or x.dtype not in kernels.INPUT_DTYPES or not kernels.available(hist.device):
        return False
    return x.reshape(-1, x.shape[-1])


def tensor_amax_directions(q, directions, shape: tuple[int, int]) -> tuple[str, ...]:
    """The ``directions`` of quantizer ``q`` whose scale derives from max|x| over the whole [M, K]
    tensor (current scaling): those an amax its producer computed stands for. The one rule for the
    general path (``Slot._known_amax``) and planned calls (``LinearPlan.x_known``). Not the
    columnwise direction of a hybrid quantized from its dequantized rowwise payload: its amax is
    taken over those values, not over x."""
    derived = q.columnwise_from_rowwise()
    return tuple(
        d for d in directions if _scales_from_tensor_amax(q.codec(d), shape) and not (derived and d == COLUMNWISE)
    )


def _scales_from_tensor_amax(codec, shape: tuple[int, int]) -> bool:
    return (
        codec is not None and codec.needs_amax() and codec.amax_space() == "x" and tuple(codec.amax_shape(shape)) == ()
    )
