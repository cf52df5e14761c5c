package gocore

import "sort"

// Block states as torch's memory snapshots name them.
const (
	StateAllocated   = "active_allocated"    // handed to a caller
	StatePendingFree = "active_pending_free" // freed, waiting for events on other streams
	StateInactive    = "inactive"            // free, cached
)

// SnapshotBlock is one block of a segment, in torch's snapshot vocabulary.
type SnapshotBlock struct {
	Address       uint64 `json:"address"`
	Size          uint64 `json:"size"`
	RequestedSize uint64 `json:"requested_size"`
	State         string `json:"state"`
}

// SnapshotSegment is one segment with its blocks in address order, with the
// keys of torch.cuda.memory._snapshot()["segments"].
type SnapshotSegment struct {
	Device        int             `json:"device"`
	Address       uint64          `json:"address"`
	TotalSize     uint64          `json:"total_size"`
	AllocatedSize uint64          `json:"allocated_size"`
	ActiveSize    uint64          `json:"active_size"`
	RequestedSize uint64          `json:"requested_size"`
	Stream        uint64          `json:"stream"`
	SegmentType   string          `json:"segment_type"` // "small" or "large"
	IsExpandable  bool            `json:"is_expandable"`
	Blocks        []SnapshotBlock `json:"blocks"`
}

// Snapshot describes every segment of the pool and its blocks, ordered by
// device and address. It takes the pool's lock for O(blocks).
func (p *Pool) Snapshot() []SnapshotSegment {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []SnapshotSegment
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		for _, s := range d.segments {
			seg := SnapshotSegment{Device: d.id, Address: s.addr, TotalSize: s.mapped(), Stream: uint64(s.stream),
				SegmentType: "large", IsExpandable: s.expandable}
			if s.kind == kindSmall {
				seg.SegmentType = "small"
			}
			for b := s.first; b != nil; b = b.next {
				if b.unmapped {
					continue // a hole: no memory (torch lists mapped ranges only)
				}
				sb := SnapshotBlock{Address: b.addr, Size: b.size, RequestedSize: b.requested, State: StateInactive}
				switch {
				case b.allocated:
					sb.State = StateAllocated
					seg.AllocatedSize += b.size
					seg.ActiveSize += b.size
					seg.RequestedSize += b.requested
				case b.pending > 0:
					sb.State = StatePendingFree
					seg.ActiveSize += b.size
					seg.RequestedSize += b.requested // as torch: until inactive
				}
				seg.Blocks = append(seg.Blocks, sb)
			}
			out = append(out, seg)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Device != out[j].Device {
			return out[i].Device < out[j].Device
		}
		return out[i].Address < out[j].Address
	})
	return out
}

// Fragmentation summarises how well reserved memory is used.
type Fragmentation struct {
	Reserved  uint64 `json:"reserved"`
	Allocated uint64 `json:"allocated"`
	// FreeBytes is reserved memory holding no active block; LargestFree is
	// the largest single free block, the biggest request servable without
	// the backend.
	FreeBytes   uint64 `json:"free_bytes"`
	LargestFree uint64 `json:"largest_free"`
	FreeBlocks  int    `json:"free_blocks"`
	// External is 1 - LargestFree/FreeBytes: 0 when all free memory is one
	// block, near 1 when it is scattered in small pieces.
	External float64 `json:"external"`
}

// FragmentationOf computes the figures over snapshot segments.
func FragmentationOf(segs []SnapshotSegment) Fragmentation {
	var f Fragmentation
	for _, s := range segs {
		f.Reserved += s.TotalSize
		f.Allocated += s.AllocatedSize
		for _, b := range s.Blocks {
			if b.State == StateInactive {
				f.FreeBytes += b.Size
				f.FreeBlocks++
				f.LargestFree = max(f.LargestFree, b.Size)
			}
		}
	}
	if f.FreeBytes > 0 {
		f.External = 1 - float64(f.LargestFree)/float64(f.FreeBytes)
	}
	return f
}
