output "helm_values_yaml" {
  description = "Values for `helm install spotjob charts/spotjob -f`: the controller's Workload Identity and its ServiceAccount name."
  value       = yamlencode(local.helm_values)
}

output "checkpoint_bucket" {
  description = "The checkpoint bucket (checkpoint.uri in examples/spotjob-gke.yaml)."
  value       = module.spotjob.checkpoint_bucket
}

output "checkpoint_uris" {
  description = "Where each namespace's jobs may write checkpoints."
  value       = module.spotjob.checkpoint_uris
}

output "training_service_accounts" {
  description = "The Google service account of each namespace's training ServiceAccount (iam.gke.io/gcp-service-account in examples/spotjob-gke.yaml)."
  value       = module.spotjob.training_service_accounts
}
