package bindings

import "syscall"

// closeFDs closes descriptors on an error path.
func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = syscall.Close(fd)
	}
}
