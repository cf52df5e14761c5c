package bindings

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The history reader shows the engine's empty_cache and trim entries as
// Python reads them: the device trimmed (-1: every device), a trim's keep
// bytes as its size.
func TestHistoryShowsEmptyCacheAndTrim(t *testing.T) {
	id, err := NewPool(`{"backend":"sim","name":"h","options":{"capacity":67108864}}`)
	require.NoError(t, err)
	defer func() { _, _ = PoolClose(id) }()
	_, err = PoolRecordHistory(id, true, 100)
	require.NoError(t, err)
	a, err := PoolAlloc(id, 1000, 0, 0)
	require.NoError(t, err)
	_, err = PoolFree(id, a)
	require.NoError(t, err)
	_, err = PoolTrim(id, 0, 1024)
	require.NoError(t, err)
	_, err = PoolEmptyCache(id)
	require.NoError(t, err)
	js, err := PoolHistory(id)
	require.NoError(t, err)
	var h []map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &h))
	require.GreaterOrEqual(t, len(h), 2)
	trim, empty := h[len(h)-2], h[len(h)-1]
	assert.Equal(t, "trim", trim["action"])
	assert.EqualValues(t, 0, trim["device"])
	assert.EqualValues(t, 1024, trim["size"])
	assert.Equal(t, "empty_cache", empty["action"])
	assert.EqualValues(t, -1, empty["device"])
}
