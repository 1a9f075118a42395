"""holeblend operator: the BlendDeployment API, CRD generation, rendering and reconcile."""
