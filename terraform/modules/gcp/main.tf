# spotjob on Google Cloud: the checkpoint bucket, Workload Identity service accounts for the
# training pods and the controller, and optionally a GKE node pool of Spot VMs with GPUs.

locals {
  bucket_name   = coalesce(var.bucket_name, "${var.name}-checkpoints-${var.project_id}")
  workload_pool = "${var.project_id}.svc.id.goog"
  bucket_prefix = "projects/_/buckets/${local.bucket_name}/objects/"
  is_bucket     = "resource.type == \"storage.googleapis.com/Bucket\""
}

# -- checkpoint bucket ------------------------------------------------------------------------------

resource "google_storage_bucket" "this" {
  name          = local.bucket_name
  project       = var.project_id
  location      = var.location
  force_destroy = var.force_destroy
  labels        = var.labels

  # IAM alone decides (the prefix conditions below need it); never public.
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # A checkpoint deleted by retention, or by mistake, stays recoverable for a while.
  versioning {
    enabled = true
  }

  # Soft delete (7 days unless set) would keep every version the lifecycle below deletes, billed,
  # that much longer again: versioning already keeps what spotjob deleted recoverable.
  soft_delete_policy {
    retention_duration_seconds = var.soft_delete_retention_days * 86400
  }

  # Only what spotjob already let go of expires: noncurrent versions of deleted checkpoints, and
  # XML API multipart uploads never completed (spotjob's are resumable sessions, which GCS drops a
  # week after they began). Live objects never expire.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_expiration_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_upload_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }

  # Cloud Storage itself encrypts with the key: its service agent must be allowed to before the
  # bucket can be created with it (and before any object can be written or read).
  depends_on = [google_kms_crypto_key_iam_member.this]

  lifecycle {
    # The default bucket name begins with name, and Cloud Storage refused one beginning with goog or
    # holding google (or g00gle) at apply (a variable's validation cannot read another variable).
    precondition {
      condition     = var.bucket_name != null || !(startswith(var.name, "goog") || strcontains(var.name, "google") || strcontains(var.name, "g00gle"))
      error_message = "name \"${var.name}\" makes the bucket name \"${local.bucket_name}\", which Cloud Storage refuses: a bucket name may not begin with goog or contain google or g00gle: choose another name, or give bucket_name."
    }
  }
}

# CMEK: the project's Cloud Storage service agent (not the training or controller identities)
# uses the key, and needs the role on it; GCS refuses every write and read of the bucket otherwise.
data "google_storage_project_service_account" "this" {
  count   = var.kms_key_name == null ? 0 : 1
  project = var.project_id
}

resource "google_kms_crypto_key_iam_member" "this" {
  count = var.kms_key_name == null ? 0 : 1

  crypto_key_id = var.kms_key_name
  role          = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
  member        = "serviceAccount:${data.google_storage_project_service_account.this[0].email_address}"
}

# -- training pods: one service account per identity, limited to its namespace and prefix ------------

resource "google_service_account" "training" {
  for_each = var.training_identities

  project      = var.project_id
  account_id   = "${var.name}-training-${each.key}"
  display_name = "spotjob training ${each.value.namespace}/${each.value.service_account}"
  description  = "spotjob training pods: checkpoints under gs://${local.bucket_name}/${each.value.prefix}/"

  lifecycle {
    precondition {
      condition     = length("${var.name}-training-${each.key}") <= 30
      error_message = "The service account ID \"${var.name}-training-${each.key}\" is longer than 30 characters: shorten name or the training_identities key."
    }
  }
}

# Workload Identity: only the Kubernetes ServiceAccount <namespace>/<service_account> may act as it.
resource "google_service_account_iam_member" "training_workload_identity" {
  for_each = var.training_identities

  service_account_id = google_service_account.training[each.key].name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${local.workload_pool}[${each.value.namespace}/${each.value.service_account}]"
}

# Objects under the prefix only: read, write, delete (retention), multipart uploads. Listing is
# checked on the bucket itself, so the Bucket branch lets a job list; it sees other prefixes'
# object names, never their content.
resource "google_storage_bucket_iam_member" "training" {
  for_each = var.training_identities

  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.training[each.key].email}"

  condition {
    title       = "spotjob-prefix-${each.key}"
    description = "Objects under ${each.value.prefix}/ only"
    expression  = "${local.is_bucket} || resource.name.startsWith(\"${local.bucket_prefix}${each.value.prefix}/\")"
  }
}

# -- the controller: read manifests, keep the ownership and attempt records ----------------------------

resource "google_service_account" "controller" {
  project      = var.project_id
  account_id   = "${var.name}-controller"
  display_name = "spotjob controller"
  description  = "spotjob controller (${var.controller_namespace}/${var.controller_service_account}): checkpoint manifests and ownership records"
}

resource "google_service_account_iam_member" "controller_workload_identity" {
  service_account_id = google_service_account.controller.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${local.workload_pool}[${var.controller_namespace}/${var.controller_service_account}]"
}

# List, read manifests, writers' claims (WRITER.json: a new job's URI that holds one is a
# checkpoint's own folder, refused) and <uri>/.spotjob/ records; never shards.
resource "google_storage_bucket_iam_member" "controller_read" {
  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.controller.email}"

  condition {
    title       = "spotjob-controller-read"
    description = "Listing, MANIFEST.json, WRITER.json and .spotjob/ records"
    expression  = "${local.is_bucket} || resource.name.endsWith(\"/MANIFEST.json\") || resource.name.endsWith(\"/WRITER.json\") || resource.name.extract(\"/.spotjob/{record}\") != \"\""
  }
}

# Create (never overwrite: no delete permission) the owner and attempt records under <uri>/.spotjob/.
resource "google_storage_bucket_iam_member" "controller_records" {
  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectCreator"
  member = "serviceAccount:${google_service_account.controller.email}"

  condition {
    title       = "spotjob-controller-records"
    description = ".spotjob/ owner and attempt records"
    expression  = "resource.name.extract(\"/.spotjob/{record}\") != \"\""
  }
}

# -- optional: a GKE node pool of Spot VMs with GPUs -----------------------------------------------

resource "google_container_node_pool" "this" {
  count = var.node_pool == null ? 0 : 1

  name           = "${var.name}-gpu-spot"
  project        = var.project_id
  cluster        = var.node_pool.cluster
  location       = var.node_pool.location
  node_locations = var.node_pool.node_locations

  # ANY: take spot capacity in whichever zone has it.
  autoscaling {
    total_min_node_count = var.node_pool.min_node_count
    total_max_node_count = var.node_pool.max_node_count
    location_policy      = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    spot         = true
    machine_type = var.node_pool.machine_type
    disk_size_gb = var.node_pool.disk_size_gb

    guest_accelerator {
      type  = var.node_pool.accelerator_type
      count = var.node_pool.accelerator_count

      gpu_driver_installation_config {
        gpu_driver_version = var.node_pool.gpu_driver_version
      }
    }

    # Pods get their Google identity from Workload Identity, never the node's.
    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    service_account = var.node_pool.service_account
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]

    # GKE itself labels Spot VMs cloud.google.com/gke-spot=true (examples/spotjob-gke.yaml selects it).
    labels = merge({ "spotjob.dev/pool" = "gpu-spot" }, var.node_pool.labels)

    # Only pods that tolerate spot capacity land here (examples/spotjob-gke.yaml does).
    taint {
      key    = "cloud.google.com/gke-spot"
      value  = "true"
      effect = "NO_SCHEDULE"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    resource_labels = var.labels
  }
}

# -- destroy guard ----------------------------------------------------------------------------------

# GCS refuses to delete a bucket that holds objects, but `terraform destroy` only gets there after
# deleting the service accounts, their Workload Identity bindings and their bucket roles: a refused
# destroy left the checkpoints with no identity that could reach them. This depends on every
# resource here, so a destroy removes it first: without force_destroy (as applied, in the state)
# it fails, and nothing else is touched. A new name or bucket_name replaces the bucket, and so
# this too (triggers_replace): refused the same way.
resource "terraform_data" "this" {
  input            = var.force_destroy
  triggers_replace = local.bucket_name

  provisioner "local-exec" {
    when    = destroy
    command = self.input ? "exit 0" : "echo spotjob: refusing to destroy: force_destroy is false, and the checkpoint bucket would go, by terraform destroy or by a new name or bucket_name, which replaces it. To delete the bucket and every checkpoint in it, apply force_destroy = true first. To keep the bucket, see Destroying in the module README. 1>&2 && exit 1"
  }

  depends_on = [
    google_storage_bucket.this,
    google_kms_crypto_key_iam_member.this,
    google_service_account.training,
    google_service_account_iam_member.training_workload_identity,
    google_storage_bucket_iam_member.training,
    google_service_account.controller,
    google_service_account_iam_member.controller_workload_identity,
    google_storage_bucket_iam_member.controller_read,
    google_storage_bucket_iam_member.controller_records,
    google_container_node_pool.this,
  ]
}
