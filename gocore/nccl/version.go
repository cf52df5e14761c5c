package nccl

// DecodeVersion splits an NCCL_VERSION_CODE as ncclGetVersion reports it.
// NCCL >= 2.9 encodes major*10000 + minor*100 + patch (2.23.4 is 22304);
// older releases encoded major*1000 + minor*100 + patch (2.8.4 is 2804). The
// old encoding stays below 10000 for any major version below 10, and the new
// one starts at 20900, so the size of the code tells them apart.
func DecodeVersion(code int) (major, minor, patch int) {
	if code >= 10000 {
		return code / 10000, code % 10000 / 100, code % 100
	}
	return code / 1000, code % 1000 / 100, code % 100
}
