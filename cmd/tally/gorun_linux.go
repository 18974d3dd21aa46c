package main

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
)

// followGoRun makes tally stop gracefully when the `go run` that started it
// is stopped. `go run ./cmd/tally serve` runs tally as a child of the go
// command, and a SIGTERM to the go command ends it without passing the
// signal on: tally, and the PostgreSQL it started, would keep running. So
// when the parent is the go command, and only then, tally asks the kernel
// for a SIGTERM when its parent dies (PR_SET_PDEATHSIG), which takes the
// usual graceful path. Under any other parent (a shell, systemd, nohup) this
// does nothing.
//
// The request belongs to the OS thread that makes it, and the kernel drops
// it if that thread exits, so it is made from a goroutine that keeps its
// thread for the life of the process.
func followGoRun() {
	ppid := os.Getppid()
	exe, err := os.Readlink("/proc/" + strconv.Itoa(ppid) + "/exe")
	if err != nil || filepath.Base(exe) != "go" {
		return
	}
	set := make(chan struct{})
	go func() {
		runtime.LockOSThread() // never unlocked: the thread lives as long as the process
		const prSetPdeathsig = 1
		_, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetPdeathsig, uintptr(syscall.SIGTERM), 0)
		close(set)
		if errno == 0 && os.Getppid() != ppid { // the go command died before the request took effect
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		}
		select {}
	}()
	<-set
}
