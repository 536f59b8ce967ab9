"""The compiler: an ArchGraph -> generated forwards and the ``nn.Module`` tree that runs them.

Imports nothing from :mod:`specvit.spec`: everything it needs is on the graph's nodes.
"""
