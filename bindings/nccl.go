package bindings

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

// NCCL user-buffer registration for gpumempool.torch on torch < 2.6 (whose
// ProcessGroupNCCL has no register_mem_pool): ncclCommRegister on the
// communicator torch made, through the libnccl the nccl backend loads, so
// that the process opens NCCL in one place.

// registrationLib is the libnccl registration goes through: libnccl.Load's
// choice (the NCCL already loaded, i.e. torch's, else $GMP_LIBNCCL, else
// the loader's libnccl.so.2), which must have ncclCommRegister.
func registrationLib() (*libnccl.Lib, error) {
	lib, err := libnccl.Load("")
	if err != nil {
		return nil, err
	}
	if err := lib.CheckCommRegister(); err != nil {
		return nil, err
	}
	return lib, nil
}

// NcclRegistrationLibrary loads the libnccl that NcclCommRegister calls and
// checks that it has ncclCommRegister/ncclCommDeregister (NCCL >= 2.19); it
// returns the library's description, e.g. "NCCL 2.23.4 (/path/libnccl.so.2)".
func NcclRegistrationLibrary() (desc string, err error) {
	defer guard(&err)
	lib, err := registrationLib()
	if err != nil {
		return "", err
	}
	return lib.String(), nil
}

// NcclCommRegister calls ncclCommRegister(comm, buf, size) of the libnccl
// NcclRegistrationLibrary names: it registers [buf, buf+size) with the NCCL
// communicator comm (an ncclComm_t, such as torch's
// ProcessGroupNCCL._comm_ptr()) and returns the handle for
// NcclCommDeregister. A failed call's error names the ncclResult_t.
func NcclCommRegister(comm, buf, size uint64) (handle uint64, err error) {
	defer guard(&err)
	lib, err := registrationLib()
	if err != nil {
		return 0, err
	}
	h, err := lib.CommRegister(uintptr(comm), uintptr(buf), size)
	if err != nil {
		return 0, fmt.Errorf("register [%#x, +%d) with NCCL communicator %#x: %w", buf, size, comm, err)
	}
	return uint64(h), nil
}

// NcclCommDeregister calls ncclCommDeregister(comm, handle) for a handle
// NcclCommRegister returned. It returns true (see okOf) or the error.
func NcclCommDeregister(comm, handle uint64) (ok bool, err error) {
	defer guard(&err)
	lib, err := registrationLib()
	if err != nil {
		return false, err
	}
	if err := lib.CommDeregister(uintptr(comm), uintptr(handle)); err != nil {
		return false, fmt.Errorf("deregister handle %#x from NCCL communicator %#x: %w", handle, comm, err)
	}
	return true, nil
}
