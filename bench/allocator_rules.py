"""PyTorch's CUDA caching allocator rules, applied by hand to an allocation trace.

A second, independent statement of the rules that mirage's allocator model (C++, in
mirage/shim/caching_allocator.cpp) follows, written from the rules as PyTorch documents and
implements them (default settings: no max_split_size, no power-of-two rounding):

  * a request is rounded up to a multiple of 512 bytes (at least 512);
  * up to 1 MiB it is served from the small pool, whose segments are 2 MiB; larger requests from
    the large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded
    up to 2 MiB otherwise;
  * the smallest cached free block of the same stream and pool that fits is used; if what is left
    is at least 512 bytes (small pool) or more than 1 MiB (large pool), the block is split;
  * a freed block merges with free neighbours of its segment;
  * (not exercised here: a failed segment reservation frees whole cached segments and retries).

Replaying the `alloc` / `free_completed` entries of a memory history gives the peak allocated
and reserved bytes these rules predict, to compare with what the model reported.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KIB, MIB = 1024, 1024 * 1024
MIN_BLOCK, SMALL_REQUEST, SMALL_SEGMENT = 512, MIB, 2 * MIB
LARGE_SEGMENT, MIN_LARGE_ALLOC, LARGE_ROUNDING = 20 * MIB, 10 * MIB, 2 * MIB


@dataclass
class Piece:
    """A block of a segment: [start, start + size)."""
    start: int
    size: int
    free: bool
    segment: "Segment"


@dataclass
class Segment:
    small: bool
    stream: int
    pieces: list[Piece] = field(default_factory=list)  # in address order


class Replay:
    def __init__(self) -> None:
        self.free_pieces: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}  # (small, stream) -> sorted (size, start, id)
        self.by_id: dict[int, Piece] = {}
        self.live: dict[int, Piece] = {}  # trace address -> piece
        self.next_start = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    @staticmethod
    def rounded(size: int) -> int:
        return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= SMALL_REQUEST:
            return SMALL_SEGMENT
        if size < MIN_LARGE_ALLOC:
            return LARGE_SEGMENT
        return -(-size // LARGE_ROUNDING) * LARGE_ROUNDING

    def _add_free(self, piece: Piece) -> None:
        piece.free = True
        self.by_id[id(piece)] = piece
        bisect.insort(self.free_pieces.setdefault((piece.segment.small, piece.segment.stream), []),
                      (piece.size, piece.start, id(piece)))

    def _remove_free(self, piece: Piece) -> None:
        self.free_pieces[(piece.segment.small, piece.segment.stream)].remove((piece.size, piece.start, id(piece)))
        piece.free = False

    def alloc(self, address: int, requested: int, stream: int) -> None:
        size = self.rounded(requested)
        small = size <= SMALL_REQUEST
        candidates = self.free_pieces.get((small, stream), [])
        at = bisect.bisect_left(candidates, (size, -1, -1))
        if at < len(candidates):
            piece = self.by_id[candidates[at][2]]
            self._remove_free(piece)
        else:
            total = self.segment_size(size)
            segment = Segment(small, stream)
            piece = Piece(self.next_start, total, False, segment)
            segment.pieces.append(piece)
            self.next_start += total
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = piece.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_REQUEST):
            tail = Piece(piece.start + size, rest, True, piece.segment)
            pieces = piece.segment.pieces
            pieces.insert(pieces.index(piece) + 1, tail)
            piece.size = size
            self._add_free(tail)
        self.live[address] = piece
        self.allocated += piece.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, address: int) -> None:
        piece = self.live.pop(address)
        self.allocated -= piece.size
        pieces = piece.segment.pieces
        at = pieces.index(piece)
        if at + 1 < len(pieces) and pieces[at + 1].free:  # merge the next piece in
            following = pieces.pop(at + 1)
            self._remove_free(following)
            piece.size += following.size
        if at > 0 and pieces[at - 1].free:  # and into the previous one
            previous = pieces[at - 1]
            self._remove_free(previous)
            previous.size += piece.size
            pieces.pop(at)
            piece = previous
        self._add_free(piece)


def replay(trace: list[dict]) -> Replay:
    """The rules applied to a device trace (torch.cuda.memory._snapshot()['device_traces'][i])."""
    state = Replay()
    for entry in trace:
        if entry["action"] == "alloc":
            state.alloc(entry["addr"], entry["size"], entry["stream"])
        elif entry["action"] == "free_completed":
            state.free(entry["addr"])
    return state
