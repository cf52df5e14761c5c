package picklescan

import "math"

// Shape bounds what unpickling a pickle builds, as gpumempool's loader counts
// it after unpickling (_safepickle._check_structure): every container (list,
// dict, tuple, set, frozenset) is 1 + its length, once per reference, so a
// container reached through several references counts that many times; depth
// is the number of containers on the longest chain from the root.
//
// The loader walks the unpickled objects to refuse shared-reference bombs,
// cycles and deep nesting; that walk costs more than unpickling itself. When
// Scan can bound the shape from the opcodes, and the bound is within the
// loader's budget, the walk has nothing to find and is skipped.
type Shape struct {
	// Known is false when the opcodes do not give a bound: the pickle calls
	// code (the unpickler refuses it), uses the stack in a way the unpickler
	// would reject, or its containers form a cycle. Nodes and Depth are then 0.
	Known bool
	// Nodes is at least the expanded size (saturating at MaxUint64). It is
	// exact but for dict keys and set elements inserted more than once, which
	// the opcodes cannot tell apart: each insertion counts.
	Nodes uint64
	// Depth is at least the nesting of containers (0: the root is not one).
	Depth int64
}

// noNode marks a stack item or memo entry that is not a container.
const noNode int32 = -1

// maxGraphNodes caps the modelled containers (node numbers are int32).
const maxGraphNodes = math.MaxInt32 - 1

// edge is one reference from a container to a container.
type edge struct{ from, to int32 }

// graph models the containers the unpickler builds and the references among
// them. The references are a superset of those in the result: a dict value or
// set element that a later insertion replaces keeps its edge, and its length
// counts every insertion. Bounds taken from it are therefore upper bounds.
//
// Its size is capped in proportion to the data (limit: containers plus
// references), so that the scan's memory stays a small multiple of the
// pickle's: real pickles make a container per 20-50 bytes. A pickle over the
// cap gets no bound, and the loader walks what it unpickles instead.
type graph struct {
	lens       []uint64 // per container: its length (an upper bound, see above)
	edges      []edge
	limit      int   // the most len(lens) + len(edges) may reach
	emptyTuple int32 // the node of (), a singleton in CPython (0: none yet)
	broken     bool  // the model lost track, or is over its cap: no bound
}

// drop gives up the bound and the memory the graph holds.
func (g *graph) drop() {
	g.broken = true
	g.lens, g.edges = nil, nil
}

// full drops the graph when n more entries would take it over its cap.
func (g *graph) full(n int) bool {
	if g.broken {
		return true
	}
	if len(g.lens)+len(g.edges)+n > min(g.limit, maxGraphNodes) {
		g.drop()
		return true
	}
	return false
}

// container makes a container of length n and returns its node.
func (g *graph) container(n uint64) int32 {
	if g.full(1) {
		return noNode
	}
	g.lens = append(g.lens, n)
	return int32(len(g.lens) - 1)
}

// empty returns the node of the empty tuple, made on first use: every
// EMPTY_TUPLE pushes the same object, counted once per reference like any
// shared container.
func (g *graph) empty() int32 {
	if g.emptyTuple == 0 {
		node := g.container(0)
		if node == noNode {
			return noNode
		}
		g.emptyTuple = node + 1
	}
	if g.broken {
		return noNode
	}
	return g.emptyTuple - 1
}

// insert adds items to the container at node (n more of its length), or
// breaks the model when node is not a container.
func (g *graph) insert(node int32, items []int32, n uint64) {
	if g.broken {
		return
	}
	if node == noNode {
		g.drop() // appending to a scalar: the unpickler fails
		return
	}
	g.lens[node] = saturatingAdd(g.lens[node], n)
	g.refer(node, items)
}

// refer records the references of node to the containers among items.
func (g *graph) refer(node int32, items []int32) {
	if node == noNode || g.full(len(items)) {
		return
	}
	for _, it := range items {
		if it != noNode {
			g.edges = append(g.edges, edge{node, it})
		}
	}
}

func saturatingAdd(a, b uint64) uint64 {
	if a > math.MaxUint64-b {
		return math.MaxUint64
	}
	return a + b
}

// shape computes the bound for the object at root: sizes and depths in one
// post-order walk over the reachable containers, each visited once (shared
// ones add their size per reference), refusing a cycle.
func (g *graph) shape(root int32) Shape {
	if g.broken {
		return Shape{}
	}
	if root == noNode {
		return Shape{Known: true}
	}
	n := len(g.lens)
	first := make([]int, n+1) // children of node i: kids[first[i]:first[i+1]]
	for _, e := range g.edges {
		first[e.from+1]++
	}
	for i := 0; i < n; i++ {
		first[i+1] += first[i]
	}
	kids := make([]int32, len(g.edges))
	fill := append([]int(nil), first[:n]...)
	for _, e := range g.edges {
		kids[fill[e.from]] = e.to
		fill[e.from]++
	}
	const (
		unseen uint8 = iota
		open
		done
	)
	state := make([]uint8, n)
	size := make([]uint64, n)
	depth := make([]int64, n)
	type frame struct {
		node int32
		next int
	}
	path := []frame{{root, first[root]}}
	state[root] = open
	for len(path) > 0 {
		f := &path[len(path)-1]
		if f.next < first[f.node+1] {
			child := kids[f.next]
			f.next++
			switch state[child] {
			case open:
				return Shape{} // a cycle: the loader's walk refuses it
			case unseen:
				state[child] = open
				path = append(path, frame{child, first[child]})
			}
			continue
		}
		node := f.node
		path = path[:len(path)-1]
		s := saturatingAdd(1, g.lens[node])
		var d int64
		for _, c := range kids[first[node]:first[node+1]] {
			s = saturatingAdd(s, size[c])
			d = max(d, depth[c])
		}
		size[node], depth[node], state[node] = s, d+1, done
	}
	return Shape{Known: true, Nodes: size[root], Depth: depth[root]}
}
