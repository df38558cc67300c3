"""Capacity: the provisioning model of the paper (``model``) and the activation scheduler the
PromptSource runs on live measurements (``scheduler``)."""
