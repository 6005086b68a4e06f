#!/usr/bin/env bash
# Builds the control plane the `apiserver` tests run (tests/cluster/) into DEST (default
# .cache/tools): kube-apiserver, kube-controller-manager and kube-scheduler from k8s.io/kubernetes,
# etcd from go.etcd.io/etcd/server/v3, and kwok from sigs.k8s.io/kwok (the kubelet of the test
# nodes). Versions are pinned by scripts/cluster-tools/go.mod and go.sum (kwok's by
# scripts/cluster-tools/kwok/). Only the Go module proxy is used; Go's module and build caches are
# reused, so a second run with the same pins does nothing and a changed pin rebuilds incrementally.
# Cold, on 2 cores: see docs/operator.md ("Testing against a real API server").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.cache/tools}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
src=$root/scripts/cluster-tools
# Below the default priority: this is a long compile on a shared machine.
nice_=${CLUSTER_TOOLS_NICE:-10}

kube_version=$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' "$src/go.mod")
stamp=$dest/.cluster-tools.$(cat "$0" "$src/go.mod" "$src/go.sum" "$src/kwok/go.mod" "$src/kwok/go.sum" | sha256sum | cut -c1-16)
bins=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
built() { for b in "${bins[@]}"; do [ -x "$dest/$b" ] || return 1; done; }
if [ -f "$stamp" ] && built; then
  echo "cluster-tools: up to date in $dest ($kube_version)"
  exit 0
fi

# The version the server reports (kubectl and helm check it): what hack/lib/version.sh would stamp.
minor=${kube_version#v1.}; minor=${minor%%.*}
ver_flags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ver_flags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ver_flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

start=$(date +%s)
echo "cluster-tools: building Kubernetes $kube_version control plane and etcd into $dest" >&2
(
  cd "$src"
  # -mod=readonly: go.sum must already pin everything; nothing is resolved anew here.
  CGO_ENABLED=0 nice -n "$nice_" go build -mod=readonly -trimpath -ldflags "-s -w$ver_flags" \
    -o "$dest/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
  CGO_ENABLED=0 nice -n "$nice_" go build -mod=readonly -trimpath -ldflags "-s -w" \
    -o "$dest/etcd" go.etcd.io/etcd/server/v3
)
# kwok plays the kubelet of the test nodes (scheduled pods run, deleted ones go).
(cd "$src/kwok" && CGO_ENABLED=0 nice -n "$nice_" go build -mod=readonly -trimpath \
   -ldflags "-s -w" -o "$dest/kwok" sigs.k8s.io/kwok/cmd/kwok)
rm -f "$dest"/.cluster-tools.*
touch "$stamp"
echo "cluster-tools: done in $(( $(date +%s) - start ))s" >&2
"$dest/kube-apiserver" --version >&2
# not `| head -1`: under pipefail, head closing the pipe early kills etcd with SIGPIPE and fails
# the whole build (exit 141) after everything was built; .ci/run then skipped the apiserver suite
etcd_version=$("$dest/etcd" --version)
echo "${etcd_version%%$'\n'*}" >&2
