"""The HTTP side: the server, the routes of the pages and the admin API, the Prometheus output,
access checks and the static files. HTTP statuses are mapped from domain errors here, nowhere else."""
