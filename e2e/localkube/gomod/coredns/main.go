// Command coredns is CoreDNS with only the plugins that e2e/localkube's cluster DNS uses: a single
// node needs the kubernetes plugin and a few housekeeping ones, not the cloud providers' plugins
// (route53, azure, clouddns, ...) that a full build compiles in. CoreDNS documents this way of
// building it: a main package that imports the chosen plugins and runs coremain.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
