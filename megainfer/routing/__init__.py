"""Request routing across attention nodes and replicas: the policies, the state a node exports
for them, and the predictive router's forecasts, step-time model and length estimator."""
