"""The WAN test bed: echo2 across network namespaces with emulated wide-area links.

``netbed`` builds the network (namespaces, veths, a switch whose ``relay`` adds one-way
delay, loss and outages; tbf rate caps), ``probe`` checks the links against their settings,
``job`` runs one topology with one launcher per host namespace and collects what happened,
``bench`` (``python -m benchmarks.wan``) runs the issue 13 conditions side by side.
Needs root; see README "WAN test bed".
"""
