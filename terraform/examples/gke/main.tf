# spotjob on an existing GKE cluster: the GCP module, wired into the chart's values.
#
#   terraform apply -var project_id=example-project -var cluster=training
#   terraform output -raw helm_values_yaml > spotjob-values.yaml
#   kubectl create namespace ml-training   # watchNamespaces below: the chart puts a Role there
#   helm install spotjob ../../../charts/spotjob -n spotjob-system --create-namespace -f spotjob-values.yaml \
#     --set image.repository=REGISTRY/spotjob-controller

provider "google" {
  project = var.project_id
  region  = var.region
}

module "spotjob" {
  source = "../../modules/gcp"

  project_id = var.project_id
  name       = "spotjob"
  location   = var.region

  # The namespace examples/spotjob-gke.yaml runs in, with its own prefix of the bucket.
  training_identities = {
    ml = {
      namespace       = "ml-training"
      service_account = "spotjob-training"
      prefix          = "ml-training"
    }
  }

  controller_namespace       = "spotjob-system"
  controller_service_account = "spotjob"

  node_pool = var.cluster == null ? null : {
    cluster  = var.cluster
    location = var.region
  }

  force_destroy = var.force_destroy
}

locals {
  # The module's values plus this example's choices. No interruption queue on GKE: notices come
  # from the node (cloud.google.com/impending-node-termination) and the agents' metadata server.
  helm_values = merge(module.spotjob.helm_values, {
    watchNamespaces = ["ml-training"]
  })
}
