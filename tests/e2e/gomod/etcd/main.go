// Command etcd is etcd's own server main, built from the published go.etcd.io/etcd modules.
//
// etcd's cmd module carries replace directives and so cannot be required from outside; its
// server module exports the same entry point. Debian's etcd-server (3.4.23) is too old for
// Kubernetes >= 1.31, which needs 3.4.29+ or 3.5.11+.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
