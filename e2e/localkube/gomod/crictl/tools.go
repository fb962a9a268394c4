//go:build tools

// Package crictl pins crictl (cri-tools v1.36.0, the release that matches Kubernetes 1.36) for
// scripts/ensure-kubernetes.sh. A module of its own, so that its requirements do not raise the
// versions that ../go.mod takes from k8s.io/kubernetes. Never compiled: the tools tag is never set.
package crictl

import (
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
