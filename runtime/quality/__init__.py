"""Quality proxies: the shadow's scores and the zero-cost inline proxy."""
