"""HTTP calls to servers on this machine or in this pod, never through a proxy.

`urllib.request.urlopen` sends every request through the proxy that `http_proxy` names,
skipping it only for hosts `no_proxy` lists exactly. Pods of clusters behind a corporate
proxy carry these variables, and the usual `no_proxy=localhost,127.0.0.1` does not cover
127.0.0.2 and up or a pod's own address: a call to the engine's own API server (the
shadow requests) or to a local test server would go to the proxy and fail there.
"""

import urllib.request

# An opener without the environment's proxies: `LOCAL.open(request, timeout=...)`.
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
