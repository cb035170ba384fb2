"""What the operator publishes about the API: the CRD generated from ``easerve_runtime.api``'s
models, and the field reference in docs/api.md. The models themselves live in
``easerve_runtime.api`` (one package, one way in)."""
