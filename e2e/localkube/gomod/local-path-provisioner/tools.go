//go:build tools

// Package localpathprovisioner pins Rancher's local-path-provisioner (the dynamic provisioner of
// kind's and k3s' default StorageClass) for scripts/ensure-kubernetes.sh. A module of its own, as
// ../crictl. Never compiled: the tools tag is never set.
package localpathprovisioner

import (
	_ "github.com/rancher/local-path-provisioner"
)
