"""K/V-cache inference (TE's InferenceParams): the cache bookkeeping DotProductAttention uses when
it is called with `inference_params`.

Usage, as in TE:

    params = InferenceParams(max_batch_size, max_seqlen_kv, num_heads_kv, head_dim_k, dtype,
                             is_paged=False, qkv_format="bshd")
    for each iteration:
        params.pre_step(OrderedDict(zip(seq_ids, step_lens)))   # e.g. [10, 1, 1]: a new prompt, two decodes
        out = model(new_tokens_hidden, inference_params=params)  # every layer's attention
        ...

pre_step names the sequences of this iteration, in the order of the batch, and how many new tokens
each brings; sequences of the previous iteration that are not named are finished and their cache
freed. A sequence seen for the first time starts empty. Each attention layer's step() then writes
the new keys and values into its cache and returns what the fused attention call needs: queries
attend to the whole cached sequence, bottom-right aligned (the new tokens are the last ones).

Incoming tensors: "bshd" [b, s, h, d] and "sbhd" [s, b, h, d] hold sequence i's new tokens in its
first step_lens[i] rows of s (the rest is padding, zero in the output); "thd" [t, h, d] holds them
packed in batch order. The bshd / sbhd batch may be padded past the b live sequences, up to
max_batch_size rows (as TE's CUDA-graphed KV-cache test feeds them): those rows are empty
sequences, zero in the output, and never written to the cache or read. The caches are BSHD:
non-paged [max_batch_size, max_seqlen_kv, h_kv, d], paged [total_num_pages, page_size, h_kv, d]
with a page table per sequence. A non-paged cache is kept as a paged one whose pages are whole
sequences (one slot each), so finished sequences free their slot without moving the others;
while the batch's slots are 0..b-1 in order the attention call reads it as a plain BSHD cache.
The library's fused attention reads the caches directly (THD, SBHD and BSHD queries;
nvte_fused_attn_fwd's paged layouts), so queries are never converted (allow_query_conversion is
accepted and has no effect).

The new keys and values go into the caches with one nvte_copy_to_kv_cache call per layer (both
caches, every sequence). The per-iteration index data (cu_seqlens, the page table) is uploaded
once per pre_step, in one copy, into persistent device buffers that each pre_step overwrites in
place, so a decode step can be captured once as a CUDA graph and replayed after every pre_step
while the batch keeps its shape and, for a non-paged cache, its slots
(tests/pytorch/test_inference_kv_cache.py).

Differences from TE worth knowing: a continuing sequence advances by its step_dict value (TE
assumes 1); num_heads_kv, head_dim_k and dtype may be left out and are then taken from the first
keys stored; total_num_pages need not be max_batch_size * pages per sequence (a step that needs
more pages than are free raises); the sequence order is step_dict's.
"""
from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.library import custom_op

from transformer_engine import _nvte

from . import _ops
from .custom_ops import eager_or_op
from .module.base import default_device

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]

FORMATS = ("bshd", "sbhd", "thd")


_TORCH = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _pack(arrays: List[np.ndarray]) -> Tuple[torch.Tensor, List[int]]:
    """The arrays' bytes in one host buffer (each at an 8-byte aligned offset: views reinterpret
    them) and the offsets. The buffer is pageable: a small non_blocking copy from pageable memory
    is staged by the driver before the call returns and does not wait for the stream's queued
    work (measured on the H100: ~0.1 ms of host time behind 20 ms of queued kernels), and it
    needs no pinned-buffer bookkeeping."""
    offs, total = [], 0
    for a in arrays:
        offs.append(total)
        total += -(-a.nbytes // 8) * 8
    host = np.empty(total, np.uint8)
    for a, o in zip(arrays, offs):
        host[o:o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    return torch.from_numpy(host), offs


def _views(buf: torch.Tensor, arrays: List[np.ndarray], offs: List[int]) -> List[torch.Tensor]:
    return [buf[o:o + a.nbytes].view(_TORCH[a.dtype]).view(a.shape) for a, o in zip(arrays, offs)]


class _Uploads:
    """Host-made index arrays (int32 / int64) copied, in one copy, into one persistent device
    buffer, and views of them: each iteration's arrays overwrite the last ones.
    The copy is queued on the current stream after the kernels that read the last contents, so
    this is safe while the cache is used from one stream (as TE's persistent cu_seqlens are); the
    views are remade only when the arrays' shapes change (decode steps keep them)."""

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None
        self.views: Dict[tuple, List[torch.Tensor]] = {}

    def __call__(self, arrays: List[np.ndarray], device: torch.device) -> List[torch.Tensor]:
        host, offs = _pack(arrays)
        total = host.numel()
        if self.buf is None or self.buf.device != device or self.buf.numel() < total:
            self.buf = torch.empty(max(total, 2 * (self.buf.numel() if self.buf is not None else 0), 256),
                                   dtype=torch.uint8, device=device)
            self.views = {}
        self.buf[:total].copy_(host, non_blocking=True)
        key = tuple((a.shape, a.dtype) for a in arrays)
        v = self.views.get(key)
        if v is None:
            v = self.views[key] = _views(self.buf, arrays, offs)
        return v


_FORMAT = {"bshd": _nvte.NVTE_QKV_Format.NVTE_BSHD, "sbhd": _nvte.NVTE_QKV_Format.NVTE_SBHD,
           "thd": _nvte.NVTE_QKV_Format.NVTE_THD}


@custom_op("transformer_engine::copy_to_kv_cache", mutates_args=("k_cache", "v_cache"))
def copy_to_kv_cache(new_k: Tensor, new_v: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                     cu_new: Tensor, cu_cached: Tensor, qkv_format: str, max_ctx_len: int) -> None:
    """nvte_copy_to_kv_cache: the step's new keys / values (contiguous, in qkv_format) into paged
    caches [pages, page_size, h, d] through page_table [b, pages per sequence] (one launch)."""
    b = page_table.shape[0]
    keep = _ops._persistent  # (the caches and the iteration's index buffers: handles kept across calls)
    _nvte.copy_to_kv_cache(_ops._tensor(new_k), _ops._tensor(new_v), keep(k_cache), keep(v_cache),
                           keep(page_table), keep(cu_new), keep(cu_cached),
                           _FORMAT[qkv_format], b, max_ctx_len, page_table.shape[1] * k_cache.shape[1],
                           page_table.shape[1], 0, _ops._stream(new_k))


@copy_to_kv_cache.register_fake
def _(new_k, new_v, k_cache, v_cache, page_table, cu_new, cu_cached, qkv_format, max_ctx_len):
    return None


copy_to_kv_cache = eager_or_op(copy_to_kv_cache)


def _token_count(what: str, n) -> int:
    """n as a Python int >= 1: any integer type (Python, NumPy, a 0-d integer tensor: what
    operator.index takes); bools and non-integers (3.0) are refused."""
    if isinstance(n, (bool, np.bool_)) or (isinstance(n, torch.Tensor) and n.dtype == torch.bool):
        raise ValueError(f"{what} must be an integer >= 1, got the bool {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r} ({type(n).__name__})") from None
    if n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n}")
    return n


def gather_pages(cache: torch.Tensor, table: torch.Tensor, b: int) -> torch.Tensor:
    """[b, pages per sequence * page_size, h, d]: each of the first b sequences' pages of a paged
    cache [pages, page_size, h, d], in table order (a copy)."""
    return cache[table[:b].long()].flatten(1, 2)


class KVCacheManager:
    """The interface InferenceParams drives (a custom manager subclasses it and is passed, as a
    class, as cache_manager): `cache[layer] = (k_cache, v_cache)`, `sequences` {seq_id: length
    after the step} in step_dict's order, and step() returning (k_cache, v_cache, page_table or None)."""

    def __init__(self, *args, **kwargs):
        self.cache: Dict[object, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: "OrderedDict[object, int]" = OrderedDict()

    def reset(self) -> None:
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number) -> None:
        raise NotImplementedError(f"{type(self).__name__}.allocate_memory")

    def pre_step(self, step_dict: "OrderedDict[object, int]") -> "OrderedDict[object, int]":
        raise NotImplementedError(f"{type(self).__name__}.pre_step")

    def step(self, layer_number, new_k: torch.Tensor, new_v: torch.Tensor, cu_new_seqlens: torch.Tensor,
             cu_cached_seqlens: torch.Tensor, qkv_format: str):
        raise NotImplementedError(f"{type(self).__name__}.step")


class PagedKVCacheManager(KVCacheManager):
    """Caches of total_num_pages pages of page_size tokens, BSHD [pages, page_size, h_kv, d]. Each
    sequence owns a list of pages (taken lowest id first); key j of a sequence sits in slot
    j % page_size of its page j // page_size. The page table of an iteration is int32
    [b, pages per sequence] (entries a sequence does not use: 0, never read)."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int] = None, device=None):
        super().__init__()
        self.total_num_pages, self.page_size = int(total_num_pages), int(page_size)
        self.num_heads, self.head_dim_k = int(num_heads), int(head_dim_k)
        self.head_dim_v = int(head_dim_v) if head_dim_v is not None else self.head_dim_k
        self.dtype, self.max_batch_size, self.max_seqlen = dtype, int(max_batch_size), int(max_seqlen)
        self.max_pages_per_seq = -(-self.max_seqlen // self.page_size)
        self.device = torch.device(device) if device is not None else None
        self.free_pages: List[int] = list(range(self.total_num_pages))
        self.allocated_pages: Dict[object, List[int]] = {}
        self.page_table: Optional[torch.Tensor] = None  # this iteration's, on the device
        self._host_table: Optional[np.ndarray] = None  # the same, made by pre_step (uploaded once)
        self._table_order: Optional[tuple] = None  # the sequences _host_table lists, in its row order
        self._uploads = _Uploads()

    def reset(self) -> None:
        super().reset()
        self.free_pages = list(range(self.total_num_pages))
        self.allocated_pages = {}
        self.page_table, self._host_table, self._table_order = None, None, None

    def _device(self) -> torch.device:
        if self.device is None:
            self.device = default_device()
        return self.device

    def allocate_memory(self, layer_number) -> None:
        dev = self._device()
        shape = (self.total_num_pages, self.page_size, self.num_heads)
        self.cache[layer_number] = (torch.zeros(*shape, self.head_dim_k, dtype=self.dtype, device=dev),
                                    torch.zeros(*shape, self.head_dim_v, dtype=self.dtype, device=dev))

    def pre_step(self, step_dict):
        lengths = OrderedDict((seq, self.sequences.get(seq, 0) + n) for seq, n in step_dict.items())
        for seq, total in lengths.items():
            if total > self.max_seqlen:
                raise ValueError(f"InferenceParams: sequence {seq!r} would hold {total} tokens, more than "
                                 f"max_seqlen_kv={self.max_seqlen}")
        finished = [seq for seq in self.sequences if seq not in lengths]
        freed = sum(len(self.allocated_pages.get(seq, ())) for seq in finished)
        need = sum(max(0, -(-total // self.page_size) - len(self.allocated_pages.get(seq, ())))
                   for seq, total in lengths.items())
        if need > len(self.free_pages) + freed:
            raise RuntimeError(f"InferenceParams: the K/V cache is full: this step needs {need} more pages of "
                               f"{self.page_size} tokens, {len(self.free_pages) + freed} are free")
        if finished:
            for seq in finished:
                self.free_pages.extend(self.allocated_pages.pop(seq, ()))
            self.free_pages.sort()  # (kept sorted: pages are taken lowest id first)
        grew = False
        for seq, total in lengths.items():
            pages = self.allocated_pages.setdefault(seq, [])
            while len(pages) * self.page_size < total:
                pages.append(self.free_pages.pop(0))
                grew = True
        self.sequences = lengths
        order = tuple(lengths)
        if grew or order != self._table_order:  # (a decode step mostly keeps the last table)
            # max_batch_size rows (the rows past the live sequences: empty ones of a padded batch),
            # so the table's shape, and its upload's, stay fixed while sequences come and go
            table = np.zeros((max(self.max_batch_size, len(step_dict)), self.max_pages_per_seq), np.int32)
            for i, seq in enumerate(lengths):
                pages = self.allocated_pages[seq]
                table[i, :len(pages)] = pages
            self._host_table, self._table_order = table, order
        self.page_table = None  # (InferenceParams uploads the table with its own arrays)
        return self.sequences

    # ---- TE's bookkeeping accessors / operations (pre_step drives them; these are for callers that
    # inspect the cache or manage pages by hand)
    def get_sequence_count(self) -> int:
        """The number of sequences in the cache (this iteration's)."""
        return len(self.sequences)

    def get_sequence_lengths(self) -> List[int]:
        """Each sequence's cached tokens after this iteration's step, in batch order."""
        return list(self.sequences.values())

    def has_free_page(self) -> bool:
        """Whether a page is left to allocate."""
        return len(self.free_pages) > 0

    def get_page_count(self, seq) -> int:
        """The number of pages allocated to sequence `seq` (0 for one that holds none)."""
        return len(self.allocated_pages.get(seq, ()))

    def get_page_list(self, seq) -> List[int]:
        """The ids of the pages allocated to sequence `seq`, in token order."""
        return list(self.allocated_pages.get(seq, ()))

    def get_page_table(self, sequences) -> torch.Tensor:
        """int32 [len(sequences), max_pages_per_seq] on the cache's device: row i lists sequences[i]'s
        pages, 0 past them (a new tensor; the attention calls use the one pre_step made)."""
        table = np.zeros((len(sequences), self.max_pages_per_seq), np.int32)
        for i, seq in enumerate(sequences):
            pages = self.get_page_list(seq)
            table[i, :len(pages)] = pages
        return torch.from_numpy(table).to(self._device())

    def allocate_page(self, seq) -> None:
        """Appends the lowest free page to sequence `seq`'s pages."""
        if not self.free_pages:
            raise RuntimeError(f"PagedKVCacheManager.allocate_page: the K/V cache is full (all "
                               f"{self.total_num_pages} pages are allocated)")
        if self.get_page_count(seq) >= self.max_pages_per_seq:
            raise ValueError(f"PagedKVCacheManager.allocate_page: sequence {seq!r} already holds "
                             f"max_pages_per_seq={self.max_pages_per_seq} pages")
        self.allocated_pages.setdefault(seq, []).append(self.free_pages.pop(0))
        self._table_order = None  # (the next pre_step remakes the page table)

    def allocate_sequence(self, seq, context_len: int) -> None:
        """Allocates the pages that context_len tokens of sequence `seq` fill (ceil(context_len /
        page_size)), all or none."""
        n = -(-_token_count("PagedKVCacheManager.allocate_sequence: context_len", context_len) // self.page_size)
        if self.get_page_count(seq) + n > self.max_pages_per_seq:
            raise ValueError(f"PagedKVCacheManager.allocate_sequence: sequence {seq!r} would hold more than "
                             f"max_pages_per_seq={self.max_pages_per_seq} pages")
        if n > len(self.free_pages):
            raise RuntimeError(f"PagedKVCacheManager.allocate_sequence: {context_len} tokens need {n} pages, "
                               f"{len(self.free_pages)} are free")
        for _ in range(n):
            self.allocate_page(seq)

    def deallocate_sequence(self, seq) -> None:
        """Returns all of sequence `seq`'s pages to the free pages."""
        if seq not in self.allocated_pages:
            raise ValueError(f"PagedKVCacheManager.deallocate_sequence: sequence {seq!r} holds no pages")
        self.free_pages.extend(self.allocated_pages.pop(seq))
        self.free_pages.sort()  # (kept sorted: pages are taken lowest id first)
        self._table_order = None

    def print_cache(self) -> None:
        """Logs the cache's state (pages used and free, each sequence's tokens and pages) at DEBUG
        level on the logger "PagedKVCacheManager"."""
        log = logging.getLogger("PagedKVCacheManager")
        used = sum(len(p) for p in self.allocated_pages.values())
        log.debug("K/V cache: %d pages of %d tokens (%d used, %d free), %d sequences", self.total_num_pages,
                  self.page_size, used, len(self.free_pages), self.get_sequence_count())
        for i, (seq, n) in enumerate(self.sequences.items()):
            log.debug("  batch row %d: sequence %r, %d tokens, pages %s", i, seq, n, self.get_page_list(seq))

    def host_arrays(self) -> List[np.ndarray]:
        """This iteration's host-made index arrays, for InferenceParams' one upload per pre_step."""
        return [self._host_table]

    def set_device_arrays(self, arrays: List[torch.Tensor]) -> None:
        """host_arrays() on the device (the views InferenceParams uploaded)."""
        (self.page_table,) = arrays

    def _write(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """One nvte_copy_to_kv_cache call: new token j of sequence i goes to position
        cached_i - new_i + j of its pages."""
        k_cache, v_cache = self.cache[layer_number]
        if self.page_table is None:  # (pre_step not driven by InferenceParams)
            self.page_table = self._uploads([self._host_table], new_k.device)[0]
        if qkv_format == "thd":
            ctx = 0
        else:
            ctx = new_k.shape[1] if qkv_format == "bshd" else new_k.shape[0]
        # one table row per batch row: the rows of cu_new_seqlens (a padded batch's empty rows included)
        table = self.page_table[:cu_new_seqlens.numel() - 1]
        copy_to_kv_cache(new_k.contiguous(), new_v.contiguous(), k_cache, v_cache, table, cu_new_seqlens,
                         cu_cached_seqlens, qkv_format, ctx)
        return k_cache, v_cache

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        k_cache, v_cache = self._write(layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format)
        return k_cache, v_cache, self.page_table


class NonPagedKVCacheManager(PagedKVCacheManager):
    """Caches [max_batch_size, max_seqlen, h_kv, d]: one slot (a page of max_seqlen tokens) per
    sequence. While the batch holds slots 0..b-1 in order, step() returns the first b slots as
    plain BSHD caches (no page table); after sequences finished or joined out of order it returns
    the whole caches with a [b, 1] table of slots (the paged attention call), moving no data."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None, device=None):
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, max_batch_size, max_seqlen,
                         head_dim_v, device)

    def pre_step(self, step_dict):
        super().pre_step(step_dict)
        slots = [self.allocated_pages[seq][0] for seq in self.sequences]
        self._in_place = slots == list(range(len(slots)))  # the batch's slots are 0..b-1 in order
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        k_cache, v_cache = self._write(layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format)
        if self._in_place:
            b = cu_new_seqlens.numel() - 1  # (a padded batch's empty rows: free slots, never read)
            return k_cache[:b], v_cache[:b], None
        return k_cache, v_cache, self.page_table


def _output_format(qkv_format: str) -> str:
    """TE's name of the attention call's layout: the queries' format, then the caches' (BSHD)."""
    return "bshd" if qkv_format == "bshd" else qkv_format + "_2bshd"


class InferenceParams:
    """K/V caches of every attention layer of a model and the sequences of the current iteration
    (see the module docstring). TE's arguments; max_sequence_length is accepted as the older name
    of max_seqlen_kv. Attributes after pre_step: batch_size, cu_seqlens_q / cu_seqlens_kv (int32
    [b + 1]: new tokens, cached tokens after the step), max_seqlen_q (longest step),
    pre_step_seqlens (int32 [b]: tokens cached before the step, e.g. RoPE offsets),
    sequences_pre_step ({seq_id: tokens cached before the step}); output_qkv_format: the last
    step's attention layout ("bshd", "sbhd_2bshd" or "thd_2bshd")."""

    def __init__(self, max_batch_size: int, max_seqlen_kv: Optional[int] = None, num_heads_kv: Optional[int] = None,
                 head_dim_k: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 head_dim_v: Optional[int] = None, is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, num_heads_q: Optional[int] = None, head_dim_q: Optional[int] = None,
                 max_ctx_len: Optional[int] = None, qkv_format: str = "bshd", cache_manager=None,
                 allow_query_conversion: bool = True, max_sequence_length: Optional[int] = None,
                 custom_cache_manager=None):
        if custom_cache_manager is not None:  # (TE's name of the argument)
            if cache_manager is not None:
                raise ValueError("InferenceParams: pass cache_manager or custom_cache_manager, not both")
            cache_manager = custom_cache_manager
        if max_seqlen_kv is None:
            max_seqlen_kv = max_sequence_length
        if max_seqlen_kv is None:
            raise ValueError("InferenceParams: max_seqlen_kv (the longest sequence the cache holds) is required")
        if int(max_batch_size) < 1 or int(max_seqlen_kv) < 1:
            raise ValueError(f"InferenceParams: max_batch_size ({max_batch_size}) and max_seqlen_kv "
                             f"({max_seqlen_kv}) must be >= 1")
        if qkv_format not in FORMATS:
            raise ValueError(f"InferenceParams: qkv_format must be one of {FORMATS}, got {qkv_format!r}")
        if is_paged and (page_size is None or int(page_size) < 1 or total_num_pages is None
                         or int(total_num_pages) < 1):
            raise ValueError("InferenceParams: a paged cache (is_paged=True) needs page_size >= 1 and "
                             "total_num_pages >= 1")
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"InferenceParams: the cache dtype must be float16, bfloat16 or float32, got {dtype}")
        self.max_batch_size, self.max_seqlen_kv = int(max_batch_size), int(max_seqlen_kv)
        self.max_sequence_length = self.max_seqlen_kv
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.is_paged = bool(is_paged)
        self.total_num_pages = int(total_num_pages) if is_paged else None
        self.page_size = int(page_size) if is_paged else None
        self.num_heads_q, self.head_dim_q, self.max_ctx_len = num_heads_q, head_dim_q, max_ctx_len
        self.input_qkv_format = qkv_format
        self.cache_qkv_format = "bshd"
        self.output_qkv_format = _output_format(qkv_format)
        self.allow_query_conversion = allow_query_conversion
        self._manager_cls = cache_manager
        self.cache_manager: Optional[KVCacheManager] = None
        if None not in (num_heads_kv, head_dim_k, dtype):
            self._make_manager()
        self._clear_step()

    def _clear_step(self) -> None:
        self.step_dict: "OrderedDict[object, int]" = OrderedDict()
        self.sequences: "OrderedDict[object, int]" = OrderedDict()
        self.sequences_pre_step: "OrderedDict[object, int]" = OrderedDict()
        self.batch_size = 0
        self.cu_seqlens_q = self.cu_seqlens_kv = self.pre_step_seqlens = None
        self._index_arrays = None  # (cu_seqlens_q, cu_seqlens_kv, pre_step_seqlens over max_batch_size rows)
        self.max_seqlen_q = 0
        self._pending = None  # step_dict of a pre_step before the caches' sizes were known
        self._uploads = _Uploads()

    def _make_manager(self, device=None) -> None:
        common = dict(num_heads=int(self.num_heads_kv), head_dim_k=int(self.head_dim_k), dtype=self.dtype,
                      head_dim_v=int(self.head_dim_v))
        if self.is_paged:
            cls = self._manager_cls or PagedKVCacheManager
            self.cache_manager = cls(total_num_pages=self.total_num_pages, page_size=self.page_size,
                                     max_batch_size=self.max_batch_size, max_seqlen=self.max_seqlen_kv, **common)
        else:
            cls = self._manager_cls or NonPagedKVCacheManager
            self.cache_manager = cls(max_batch_size=self.max_batch_size, max_seqlen=self.max_seqlen_kv, **common)
        if device is not None and getattr(self.cache_manager, "device", 1) is None:
            self.cache_manager.device = torch.device(device)

    def __repr__(self) -> str:
        where = (f"paged, total_num_pages={self.total_num_pages}, page_size={self.page_size}" if self.is_paged
                 else f"max_batch_size={self.max_batch_size}")
        return (f"InferenceParams({where}, max_seqlen_kv={self.max_seqlen_kv}, num_heads_kv={self.num_heads_kv}, "
                f"head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v}, dtype={self.dtype}, "
                f"qkv_format={self.input_qkv_format!r})")

    def reset(self) -> None:
        """Forgets every sequence (the caches stay allocated)."""
        if self.cache_manager is not None:
            self.cache_manager.reset()
        self._clear_step()

    def allocate_memory(self, layer_number, qkv_format: Optional[str] = None) -> None:
        """Allocates layer_number's K and V caches (done by the first step() otherwise)."""
        if self.cache_manager is None:
            raise ValueError("InferenceParams: allocate_memory needs num_heads_kv, head_dim_k and dtype (or let the "
                             "first step() allocate from the keys it stores)")
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: "OrderedDict[object, int]") -> None:
        """Starts an iteration: step_dict {seq_id: new tokens}, in batch order."""
        if not isinstance(step_dict, dict) or not step_dict:
            raise ValueError("InferenceParams.pre_step: step_dict must be a non-empty OrderedDict {seq_id: new tokens}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"InferenceParams.pre_step: {len(step_dict)} sequences, more than max_batch_size="
                             f"{self.max_batch_size}")
        # (a copy with Python ints: the state changes only once the step is accepted)
        step_dict = OrderedDict((seq, _token_count(f"InferenceParams.pre_step: sequence {seq!r}'s new tokens", n))
                                for seq, n in step_dict.items())
        if self.cache_manager is None:  # sizes come with the first keys: bookkeeping only until then
            if self._pending is not None:
                raise RuntimeError("InferenceParams.pre_step: the previous iteration stored no keys (no step() "
                                   "since its pre_step), so the cache sizes are still unknown; pass num_heads_kv, "
                                   "head_dim_k and dtype to InferenceParams")
            lengths = OrderedDict((s, self.sequences.get(s, 0) + n) for s, n in step_dict.items())
            for s, total in lengths.items():
                if total > self.max_seqlen_kv:
                    raise ValueError(f"InferenceParams: sequence {s!r} would hold {total} tokens, more than "
                                     f"max_seqlen_kv={self.max_seqlen_kv}")
            self._pending = step_dict
        else:
            lengths = self.cache_manager.pre_step(step_dict)
        self.step_dict = step_dict
        self.sequences = OrderedDict((s, int(lengths[s])) for s in self.step_dict)
        self.batch_size = b = len(self.step_dict)
        self.sequences_pre_step = OrderedDict((s, self.sequences[s] - n) for s, n in self.step_dict.items())
        lens_q = np.fromiter(self.step_dict.values(), np.int64, b)
        lens_kv = np.fromiter(self.sequences.values(), np.int64, b)
        self.max_seqlen_q = int(lens_q.max())
        self._rope_extent = (int(lens_kv.max()), int((lens_kv - lens_q).max()))  # (see rope_rows)
        # the index arrays cover max_batch_size rows: a BSHD/SBHD batch padded past the live sequences
        # (as for a CUDA graph of max_batch_size rows) has empty sequences there (no new or cached
        # tokens: cu_seqlens repeat their last value, RoPE offsets 0)
        n = max(self.max_batch_size, b)
        cu = np.zeros((2, n + 1), np.int64)
        np.cumsum(lens_q, out=cu[0, 1:b + 1])
        np.cumsum(lens_kv, out=cu[1, 1:b + 1])
        cu[:, b + 1:] = cu[:, b:b + 1]
        if cu[1, -1] >= np.iinfo(np.int32).max:
            raise ValueError("InferenceParams: the batch holds more than 2^31 cached tokens")
        pre = np.zeros(n, np.int32)
        pre[:b] = lens_kv - lens_q
        m = self.cache_manager
        extra = m.host_arrays() if m is not None and hasattr(m, "host_arrays") else []
        views = self._uploads([cu[0].astype(np.int32), cu[1].astype(np.int32), pre, *extra],
                              self._device())  # one host-to-device copy per iteration
        self._set_index_arrays(*views[:3])
        if extra:
            m.set_device_arrays(views[3:])

    def _set_index_arrays(self, cu_q: torch.Tensor, cu_kv: torch.Tensor, pre: torch.Tensor) -> None:
        """The index arrays of max_batch_size rows, and the public attributes: their live rows."""
        self._index_arrays = (cu_q, cu_kv, pre)
        b = self.batch_size
        self.cu_seqlens_q, self.cu_seqlens_kv, self.pre_step_seqlens = cu_q[:b + 1], cu_kv[:b + 1], pre[:b]

    def _batch_rows(self, batch: int, who: str) -> int:
        """batch, checked as the batch dimension of this iteration's inputs: the live sequences,
        optionally followed by empty rows up to max_batch_size."""
        if not self.batch_size <= batch <= self._index_arrays[2].numel():
            raise ValueError(f"{who}: the inputs' batch dimension must hold the {self.batch_size} sequences of "
                             f"pre_step, optionally padded with empty rows up to max_batch_size="
                             f"{self.max_batch_size}; got {batch}")
        return batch

    def get_seqlens_pre_step(self, batch_size: Optional[int] = None) -> Optional[torch.Tensor]:
        """int32 [b]: the tokens each sequence had cached before this iteration (None before
        pre_step). With batch_size (a BSHD/SBHD batch padded past the b live sequences), int32
        [batch_size] with 0 for the empty rows."""
        if batch_size is None or self.pre_step_seqlens is None:
            return self.pre_step_seqlens
        b = self._batch_rows(batch_size, "InferenceParams.get_seqlens_pre_step")
        return self._index_arrays[2][:b]

    def rope_rows(self, s: int) -> Tuple[int, int]:
        """(positions a RoPE table must hold for this iteration: every cached token's, positions a
        padded BSHD/SBHD step of s rows per sequence reaches): a shorter sequence's padding rows, and
        an empty row's, run past its last token."""
        tokens, max_pre = self._rope_extent
        return tokens, max_pre + int(s)

    def _device(self) -> torch.device:
        m = self.cache_manager
        dev = getattr(m, "device", None) if m is not None else None
        return dev if dev is not None else default_device()

    def _check_new(self, new_q, new_k, new_v, qkv_format: str) -> int:
        """Checks the step's inputs; returns their batch rows (b, or more for a padded batch)."""
        b, lens = self.batch_size, list(self.step_dict.values())
        rank = 3 if qkv_format == "thd" else 4
        for name, t in (("query", new_q), ("key", new_k), ("value", new_v)):
            if t.dim() != rank:
                raise ValueError(f"InferenceParams.step: {name} must be {rank}D in {qkv_format!r}, got "
                                 f"{tuple(t.shape)}")
        if qkv_format == "thd":
            if min(t.shape[0] for t in (new_q, new_k, new_v)) < sum(lens):
                raise ValueError(f"InferenceParams.step: 'thd' inputs need {sum(lens)} token rows (the step's new "
                                 f"tokens), got {new_q.shape[0]}, {new_k.shape[0]}, {new_v.shape[0]}")
            return b
        bi, si = (0, 1) if qkv_format == "bshd" else (1, 0)
        rows = new_q.shape[bi]
        for t in (new_q, new_k, new_v):
            if t.shape[bi] != rows or t.shape[si] < max(lens) or not b <= rows <= self._index_arrays[2].numel():
                raise ValueError(f"InferenceParams.step: {qkv_format!r} inputs need batch {b} (pre_step's sequences; "
                                 f"or more, up to max_batch_size={self.max_batch_size}: empty rows) and at least "
                                 f"{max(lens)} rows per sequence, got query {tuple(new_q.shape)}, key "
                                 f"{tuple(new_k.shape)}, value {tuple(new_v.shape)}")
        return rows

    def step(self, layer_number, new_q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Stores the iteration's new keys and values of layer_number. Returns (q, k_cache, v_cache,
        page_table or None, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, qkv_format):
        q as given; the caches BSHD; max_seqlen_kv the caches' capacity per sequence; qkv_format
        "bshd", "sbhd_2bshd" or "thd_2bshd" (query format, then the caches')."""
        if not self.step_dict:
            raise RuntimeError("InferenceParams.step: call pre_step(step_dict) before the model's forward")
        if qkv_format not in FORMATS:
            raise ValueError(f"InferenceParams.step: qkv_format must be one of {FORMATS}, got {qkv_format!r}")
        rows = self._check_new(new_q, new_k, new_v, qkv_format)
        if self.cache_manager is None:
            self.num_heads_kv, self.head_dim_k = new_k.shape[-2], new_k.shape[-1]
            self.head_dim_v, self.dtype = new_v.shape[-1], new_k.dtype
            self._make_manager(new_k.device)
            self.cache_manager.pre_step(self._pending)
            self._pending = None
        m = self.cache_manager
        if not m.cache and isinstance(m, PagedKVCacheManager) and m._device() != new_k.device:
            # no cache allocated yet: the caches follow the first keys (not the default device)
            m.device = new_k.device
            m.page_table = None  # (uploaded to the keys' device by the first write)
        if self.cu_seqlens_q.device != new_k.device:
            self._set_index_arrays(*(x.to(new_k.device) for x in self._index_arrays))
        if layer_number not in m.cache:
            m.allocate_memory(layer_number)
        k_cache = m.cache[layer_number][0]
        if new_k.device != k_cache.device or new_k.dtype != k_cache.dtype or new_v.dtype != k_cache.dtype:
            raise ValueError(f"InferenceParams.step: new keys/values ({new_k.dtype}, {new_v.dtype} on {new_k.device}) "
                             f"must match the cache ({k_cache.dtype} on {k_cache.device})")
        if new_k.shape[-2:] != k_cache.shape[-2:] or new_v.shape[-1] != m.cache[layer_number][1].shape[-1]:
            raise ValueError(f"InferenceParams.step: new keys {tuple(new_k.shape)} / values {tuple(new_v.shape)} do "
                             f"not match the cache's heads and head sizes {tuple(k_cache.shape[-2:])}, "
                             f"{m.cache[layer_number][1].shape[-1]}")
        if rows == self.batch_size:
            cu_q, cu_kv = self.cu_seqlens_q, self.cu_seqlens_kv
        else:  # a padded batch: its empty rows have no new or cached tokens (never written or read)
            cu_q, cu_kv = (x[:rows + 1] for x in self._index_arrays[:2])
        res = m.step(layer_number, new_k, new_v, cu_q, cu_kv, qkv_format)
        k_cache, v_cache, table = res if len(res) == 3 else (*res, None)  # (a manager returning (k, v): non-paged)
        if table is not None:
            table = table[:rows]
        got, what = (table, "a page table") if table is not None else (k_cache, "caches")
        if got.shape[0] < rows:
            raise ValueError(f"InferenceParams.step: the cache manager returned {what} of {got.shape[0]} rows for a "
                             f"batch of {rows}")
        capacity = self.max_seqlen_kv if table is None else table.shape[1] * k_cache.shape[1]
        self.input_qkv_format, self.output_qkv_format = qkv_format, _output_format(qkv_format)
        max_sq = new_q.shape[1] if qkv_format == "bshd" else (new_q.shape[0] if qkv_format == "sbhd"
                                                               else self.max_seqlen_q)
        return (new_q, k_cache, v_cache, table, cu_q, cu_kv, max_sq, capacity, self.output_qkv_format)

    def convert_paged_to_nonpaged(self, layer_number, qkv_format: str = "bshd"):
        """(k, v) of layer_number's cache after this iteration's step, each sequence's keys in order
        and contiguous (a copy): "bshd" [b, pages * page_size, h, d] (positions past a sequence's
        length hold stale or zero values), "sbhd" the same transposed, "thd" the sequences' cached
        tokens packed by cu_seqlens_kv [total, h, d]."""
        m = self.cache_manager
        if m is None or layer_number not in m.cache:
            raise ValueError(f"InferenceParams.convert_paged_to_nonpaged: layer {layer_number!r} has no cache yet")
        if qkv_format not in FORMATS:
            raise ValueError(f"InferenceParams.convert_paged_to_nonpaged: qkv_format must be one of {FORMATS}")
        table = getattr(m, "page_table", None)
        if table is None:
            raise RuntimeError("InferenceParams.convert_paged_to_nonpaged: no page table (call pre_step first)")
        out = []
        for c in m.cache[layer_number]:
            x = gather_pages(c, table, self.batch_size)
            if qkv_format == "sbhd":
                x = x.transpose(0, 1).contiguous()
            elif qkv_format == "thd":
                x = torch.cat([x[i, :n] for i, n in enumerate(self.sequences.values())])
            out.append(x)
        return tuple(out)

    def post_step(self, layer_number, output: torch.Tensor) -> torch.Tensor:
        """The attention output in the incoming format (queries are never converted here)."""
        return output
