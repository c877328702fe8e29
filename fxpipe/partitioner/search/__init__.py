"""The cluster search: the fastest way to train one profile on N devices (``fxpipe plan --devices``).

``configurations.search_configurations`` tries pipeline depth x replicas x microbatches x
schedule x sharding (``shapes``), prices each (``pricing``), ranks them (``result``) and says
why the others lose (``explain``); ``report`` prints the ranking and ``args`` declares the flags.
"""
