//go:build tools

// The command scripts/cluster-tools.sh builds from this module.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
