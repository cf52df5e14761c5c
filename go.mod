module github.com/gpumempool/gpumempool

go 1.23.0

require (
	github.com/NVIDIA/go-nvml v0.13.0-1
	github.com/go-python/gopy v0.4.10
	github.com/google/btree v1.1.3
	github.com/stretchr/testify v1.10.0
	golang.org/x/sync v0.12.0
	golang.org/x/tools v0.30.0
)

require (
	github.com/davecgh/go-spew v1.1.1 // indirect
	github.com/gonuts/commander v0.1.0 // indirect
	github.com/gonuts/flag v0.1.0 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/pmezard/go-difflib v1.0.0 // indirect
	golang.org/x/mod v0.23.0 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
)
