# spotjob on an existing EKS cluster: the AWS module, wired into the chart's values.
#
#   terraform apply -var oidc_provider_arn=arn:aws:iam::111122223333:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE
#   terraform output -raw helm_values_yaml > spotjob-values.yaml
#   kubectl create namespace ml-training   # watchNamespaces below: the chart puts a Role there
#   helm install spotjob ../../../charts/spotjob -n spotjob-system --create-namespace -f spotjob-values.yaml \
#     --set image.repository=REGISTRY/spotjob-controller

provider "aws" {
  region = var.region
}

module "spotjob" {
  source = "../../modules/aws"

  name              = "spotjob"
  oidc_provider_arn = var.oidc_provider_arn

  # The namespace examples/spotjob-eks.yaml runs in, with its own prefix of the bucket.
  training_identities = {
    ml-training = {
      namespace       = "ml-training"
      service_account = "spotjob-training"
      prefix          = "ml-training"
    }
  }

  controller_namespace       = "spotjob-system"
  controller_service_account = "spotjob"

  node_group = var.cluster_name == null ? null : {
    cluster_name = var.cluster_name
    subnet_ids   = var.subnet_ids
  }

  force_destroy = var.force_destroy
  tags          = var.tags
}

locals {
  # The module's values plus this example's choices; the chart's values.yaml documents each key.
  helm_values = merge(module.spotjob.helm_values, {
    watchNamespaces = ["ml-training"]
  })
}
