//go:build tools

// Package gomod pins the Kubernetes release and the etcd server that e2e/localkube runs, and nothing
// else: scripts/ensure-kubernetes.sh builds the commands named below from this module (go.mod and
// go.sum are the pins). The blank imports keep `go mod tidy` from dropping them; they are programs,
// not libraries, so this file is never compiled (the tools build tag is never set).
package gomod

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
