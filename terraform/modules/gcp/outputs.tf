output "checkpoint_bucket" {
  description = "The checkpoint bucket's name."
  value       = google_storage_bucket.this.name
}

output "checkpoint_uris" {
  description = "Per training identity, the URI its jobs' checkpoint.uri must lie under: gs://<bucket>/<prefix>/<job>."
  value       = { for k, v in var.training_identities : k => "gs://${google_storage_bucket.this.name}/${v.prefix}" }
}

output "training_service_accounts" {
  description = "Per training identity, the Google service account to annotate its Kubernetes ServiceAccount with (iam.gke.io/gcp-service-account)."
  value       = { for k, sa in google_service_account.training : k => sa.email }
}

output "controller_service_account" {
  description = "The controller's Google service account: the chart's serviceAccount.gcp.serviceAccount."
  value       = google_service_account.controller.email
}

output "node_pool_name" {
  description = "The spot GPU node pool's name (null when none was created)."
  value       = var.node_pool == null ? null : google_container_node_pool.this[0].name
}

output "helm_values" {
  description = "The chart values this module determines, to merge into the spotjob release's values (yamlencode it into a -f file)."
  value = {
    serviceAccount = {
      name = var.controller_service_account
      gcp  = { serviceAccount = google_service_account.controller.email }
    }
  }
}
