"""Dynamo workers: the encode, prefill and decode endpoints, the HTTP frontend, the local launcher."""
