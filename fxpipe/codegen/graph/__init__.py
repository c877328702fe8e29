"""Stage graphs: splitting the traced graph by the plan, which stage owns which weight, module calls outlined back, scopes and aliases."""
